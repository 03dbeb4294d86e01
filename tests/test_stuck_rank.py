"""A stopped rank (SIGSTOP: alive, silent) is named by every survivor, which all exit 3 in time.

For real: 3 ranks of ``launcher.train`` under mpiexec (the mpi backend, and gloo), one stopped
mid-training. A stopped process raises nothing and answers nothing, so only the heartbeats'
silence (``launcher.faults.heartbeat``) can name it. Plain processes with torchrun's variables for
gloo as well, 3 of them: there each survivor's own exit status can be read (Hydra ends the others
once one rank exits).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.errors import EXIT_PEER_LOST
from launcher.placement.ports import free_port
from tests.fixtures.mpi import REPO_ROOT, clean_environ, end_job, mpiexec_path

WORLD = 3
TIMEOUT_S = 15
#: the bound the survivors must end within, after the timeout
GRACE_S = 10


def _train(backend: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "launcher.train", "--epochs", "500", "--global-batch-size",
            "48", "--run-dir", str(run_dir), "--timeout-s", str(TIMEOUT_S), "--backend",
            backend, "--threads", "1", "--log-every", "1"]


def _pid_of_rank(tag: str, rank: int, variable: str) -> int:
    """The rank's process: its environment holds this test's tag and its rank."""
    wanted = {f"DDP_TEST_TAG={tag}".encode(), f"{variable}={rank}".encode()}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                environ = set((proc / "environ").read_bytes().split(b"\0"))
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if wanted <= environ and b"launcher.train" in cmdline:
                return int(proc.name)
        time.sleep(0.2)
    pytest.fail(f"no process for rank {rank}")


def _wait_until_training(process: subprocess.Popen, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if re.match(r"(\[\d+\] )?step ", line):
            return
        if not line and process.poll() is not None:
            pytest.fail(f"ended before training: {process.stderr.read()}")
    pytest.fail("no training step within the time limit")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _orphans(names: set[str]) -> set[str]:
    """Those of ``names`` nobody uses any more: other tests on this machine may be running MPI
    now, so an entry counts as left behind only once no live process maps it (MPICH's segments)
    and its launcher daemon is gone (``ddp-cma-<launcher>-<pid>-<start>``, launcher.mpi.cma)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= set(re.findall(r"/dev/shm/(\S+)", maps.read_text()))
    orphans = set()
    for name in names - mapped:
        daemon = re.match(r"ddp-cma-[a-z]+-(\d+)-", name)
        if daemon is None or not Path(f"/proc/{daemon[1]}").exists():
            orphans.add(name)
    return orphans


def _assert_named(stderr: str, survivor: int, victim: int) -> None:
    line = f"[rank {survivor}] error: "
    assert line in stderr, stderr
    assert re.search(rf"no heartbeat for \d+ s from rank {victim} \(\S+\)", stderr), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-stopped", "rank0-stopped"])
def test_mpi_backend_survivor_names_the_stopped_rank(tmp_path, victim):
    """2 ranks: Hydra ends every rank once one exits, so only the first survivor's word shows."""
    shm_before = _shm()
    tag = f"{os.getpid()}-{victim}"
    survivor = 1 - victim
    process = subprocess.Popen(
        [str(mpiexec_path()), "-n", "2", *_train("mpi", tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env=clean_environ({"DDP_TEST_TAG": tag}), start_new_session=True)
    stopped = None
    try:
        _wait_until_training(process)
        stopped = _pid_of_rank(tag, victim, "PMI_RANK")
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = process.communicate(timeout=TIMEOUT_S + GRACE_S + 30)
        took = time.monotonic() - stopped_at
        assert process.returncode == EXIT_PEER_LOST, stderr
        assert took < TIMEOUT_S + GRACE_S, (took, stderr)
        _assert_named(stderr, survivor, victim)
        assert f"rank {survivor} (" not in stderr, stderr
    finally:
        end_job(process, stopped)
    time.sleep(1)
    assert _orphans(_shm() - shm_before) == set(), "shared memory left behind"


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-stopped", "rank0-stopped"])
def test_gloo_every_survivor_exits_3_naming_the_stopped_rank(tmp_path, victim):
    """Each rank its own process (no launcher to end the others): every survivor decides."""
    port = free_port()
    ranks = [subprocess.Popen(
        _train("gloo", tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO_ROOT, env=clean_environ({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })) for rank in range(WORLD)]
    try:
        _wait_until_training(ranks[0])
        ranks[victim].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        for rank, process in enumerate(ranks):
            if rank == victim:
                continue
            _, stderr = process.communicate(timeout=TIMEOUT_S + GRACE_S + 30)
            assert process.returncode == EXIT_PEER_LOST, stderr
            assert time.monotonic() - stopped_at < TIMEOUT_S + GRACE_S, stderr
            # rank 0 too: the store it hosts carries no beats, its watchers hear its silence
            _assert_named(stderr, rank, victim)
    finally:
        for process in ranks:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.communicate()

