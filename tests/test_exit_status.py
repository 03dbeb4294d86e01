"""The status file under torchrun: the batch script learns "preempted" where torchrun says 1;
the lost nodes' names beside it.

A lost peer's file is checked in tests/test_peer_lost.py, the script's reading of it in
tests/test_batch_script.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.api import checkpoint
from launcher.core import run_files
from launcher.core.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, PeerLost
from launcher.faults import exit_status
from tests.fixtures.mpi import REPO_ROOT, clean_environ
from tests.fixtures.training import RESUME_FLAGS, wait_for_step


def _rank_1(root: int) -> int:
    """The pid of torchrun's rank 1 (``RANK=1`` in its environment), below ``root``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"RANK=1" in environ and int(stat[1]) == root:
            return int(entry.name)
    raise AssertionError("no rank 1 below torchrun")


def test_preemption_under_torchrun_is_written_where_torchrun_says_1(tmp_path):
    status_file = tmp_path / "exit-status"
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "launcher.train", "--run-dir", str(tmp_path), "--data-dir", str(tmp_path / "data"),
         "--backend", "gloo", *RESUME_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_environ(),
        cwd=REPO_ROOT, start_new_session=True)
    try:
        wait_for_step(process, tmp_path, 3, timeout=180)
        os.kill(_rank_1(process.pid), signal.SIGUSR1)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 1, stderr  # torchrun's, whatever the ranks' status
    saved = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert len(saved) == 1, stderr
    assert status_file.read_text() == f"{EXIT_PREEMPTED} preempted, {saved[0]} saved\n"



def test_lost_peer_names_its_nodes_beside_the_status(tmp_path):
    """``lost-nodes``: what the batch script excludes from the requeued job, one per line."""
    with pytest.raises(PeerLost), exit_status.recorded(tmp_path, rank=1):
        raise PeerLost("rank 1 on n0 lost contact: rank 2 (n2), rank 3 (n3)", nodes=("n2", "n3"))
    assert (tmp_path / run_files.LOST_NODES_FILE).read_text() == "n2\nn3\n"
    status = (tmp_path / run_files.EXIT_STATUS_FILE).read_text()
    assert status.startswith(f"{EXIT_PEER_LOST} rank 1")


def test_a_thread_ends_the_rank_for_a_lost_peer_as_the_main_thread_would(tmp_path):
    """``exits.lost_peer_ending`` (nccl's waits are watched by a thread): the same files, the
    error and its HINT on stderr, exit 3, from a thread whose main thread waits elsewhere."""
    script = (
        "import threading, time\n"
        "from launcher.core.errors import PeerLost\n"
        "from launcher.faults import exits\n"
        "from launcher.placement.env import detect_environment\n"
        "end = exits.lost_peer_ending(detect_environment({}), __import__('pathlib').Path(RUN))\n"
        "lost = PeerLost('all_reduce on the GPU did not complete: rank 1 (n1)', 'look at n1',"
        " nodes=('n1',))\n"
        "threading.Thread(target=end, args=(lost,)).start()\n"
        "time.sleep(60)\n").replace("RUN", repr(str(tmp_path)))
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60, env=clean_environ(), cwd=REPO_ROOT)
    assert ended.returncode == EXIT_PEER_LOST, ended.stderr
    assert ended.stderr.splitlines() == [
        "[rank 0] error: all_reduce on the GPU did not complete: rank 1 (n1)",
        "[rank 0] HINT: look at n1"], ended.stderr
    assert (tmp_path / run_files.LOST_NODES_FILE).read_text() == "n1\n"
    assert (tmp_path / run_files.EXIT_STATUS_FILE).read_text().startswith(
        f"{EXIT_PEER_LOST} all_reduce on the GPU did not complete")


def test_a_survivor_that_named_nobody_leaves_the_names_alone(tmp_path):
    (tmp_path / run_files.LOST_NODES_FILE).write_text("n2\n")  # another survivor's
    with pytest.raises(PeerLost), exit_status.recorded(tmp_path, rank=0):
        raise PeerLost("rank 0 on n0 lost contact")
    assert (tmp_path / run_files.LOST_NODES_FILE).read_text() == "n2\n"


@pytest.mark.mpi
def test_a_user_error_found_in_the_run_directory_keeps_its_reason(tmp_path, mpi_runner):
    """Found by every rank after the run directory exists: the reason, not "a rank failed"."""
    run_dir = tmp_path / "run"
    result = mpi_runner(2, ["-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir",
                            str(tmp_path / "data"), "--grad-accum", "2",
                            "--global-batch-size", "63"], timeout=120)
    assert result.returncode == 2, result.output
    assert (run_dir / run_files.EXIT_STATUS_FILE).read_text() == (
        "2 a global batch of 63 samples does not divide into 2 ranks x 2 micro-batches\n")


def test_a_run_that_ends_before_its_first_record_leaves_no_metrics_file(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir",
         str(tmp_path / "data"), "--global-batch-size", "100000"],
        capture_output=True, text=True, env=clean_environ(), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "starting from scratch" in result.stdout, result.stdout
    assert not (run_dir / "metrics.jsonl").exists()
