"""The batch script's decisions, with srun and scontrol stubbed: the lost nodes joined to the
excluded ones, restarts counted per job and then the status passed on, preemption not counted,
a preflight's slow nodes, a node range; and the script as text (golden, shellcheck).
The same script on a real 3-node Slurm: tests/test_requeue.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ddp_tasks.batch_script import Batch, batch_script, node_range
from ddp_tasks.launch_spec import Launch
from launcher.core.errors import EXIT_HUNG, LaunchError
from tests.fixtures.golden import golden
from tests.fixtures.requirements import missing
from tests.fixtures.tasks_cli import on_path, stub_dir


def attempts(run_dir: Path) -> list[tuple[str, str]]:
    """(node list, what happened) per line of the attempt log."""
    text = (run_dir / "attempts.log").read_text()
    return re.findall(r"^\S+ job \d+ attempt \d+ on (\S+): (.*)$", text, re.M)


# -- the script's decisions, with srun and scontrol stubbed -----------------------------------

#: a launch whose run directory is ``run`` below the script's working directory
STUBBED = Launch(nodes=2, procs_per_node=1, launcher="srun", runtime="none",
                 args=("--run-dir", "run", "--resume", "auto"))
#: what a survivor writes when it names the lost node
LOST = 'mkdir -p run; printf "%s\\n" $LOST > run/lost-nodes; echo "3 lost" > run/exit-status'


def _run_stubbed(tmp_path: Path, batch: Batch, srun: str, *, show: str = "(null)",
                 log: str = "", lost: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script with stubs; its result and every scontrol call (one line each)."""
    stubs = stub_dir(tmp_path, {
        "srun": f'echo "$*" >> "$STUB_LOG/srun"\n{srun}',
        "scontrol": 'echo "$*" >> "$STUB_LOG/scontrol"\n'
                    '[ "$1" != show ] || echo "JobId=4242 ExcNodeList=$SHOW Features=(null)"',
    })
    if log:
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "attempts.log").write_text(log)
    script = tmp_path / "job.sh"
    script.write_text(batch_script(STUBBED, batch))
    env = {**os.environ, "PATH": on_path(stubs),
           "STUB_LOG": str(tmp_path), "SHOW": show, "LOST": lost, "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2"}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            cwd=tmp_path, timeout=30)
    calls = tmp_path / "scontrol"
    return result, calls.read_text().splitlines() if calls.exists() else []


def _endings(tmp_path: Path) -> list[str]:
    return [ending for _, ending in attempts(tmp_path / "run")]


def test_lost_nodes_join_the_nodes_excluded_before(tmp_path):
    result, calls = _run_stubbed(tmp_path, Batch(), f"{LOST}; exit 143", show="n5",
                                 lost="n1 n2")
    assert result.returncode == 0, result.stderr
    assert calls == ["show job 4242", "requeue 4242",
                     "update JobId=4242 ExcNodeList=n5,n1,n2"]
    assert _endings(tmp_path) == ["exit 3, lost n1,n2: restart 1 of 3 without n1,n2"]
    assert "job 4242: exit 3, lost n1,n2: requeueing without n1,n2" in result.stderr


def test_a_lost_node_nobody_named_still_requeues(tmp_path):
    result, calls = _run_stubbed(tmp_path, Batch(),
                                 'mkdir -p run; echo "3 x" > run/exit-status; exit 1')
    assert result.returncode == 0, result.stderr
    assert calls == ["requeue 4242"]
    assert _endings(tmp_path) == ["exit 3, lost a node nobody named: restart 1 of 3"]


def test_restarts_are_counted_per_job_and_then_the_status_passes_on(tmp_path):
    earlier = ("2026-01-01T00:00:00Z job 4242 attempt 1 on n[0-1]: exit 3, lost n1: "
               "restart 1 of 2 without n1\n"
               "2026-01-01T00:00:00Z job 99 attempt 1 on n[0-1]: exit 3, lost n1: "
               "restart 1 of 2 without n1\n")  # another job's: not counted
    result, calls = _run_stubbed(tmp_path, Batch(max_restarts=2), f"{LOST}; exit 1",
                                 log=earlier, lost="n2")
    assert result.returncode == 0 and calls[-1] == "update JobId=4242 ExcNodeList=n2"
    (tmp_path / "scontrol").unlink()
    (tmp_path / "stubs").rename(tmp_path / "old-stubs")
    log = (tmp_path / "run" / "attempts.log").read_text()
    result, calls = _run_stubbed(tmp_path, Batch(max_restarts=2), f"{LOST}; exit 1",
                                 log=log, lost="n0")
    assert result.returncode == 3, result.stderr
    assert calls == []
    assert _endings(tmp_path)[-2:] == ["exit 3, lost n0; all 2 restarts used",
                                       "exit 3: passed on"]


def test_preemption_is_not_counted(tmp_path):
    used_up = "".join(f"2026-01-01T00:00:00Z job 4242 attempt {n} on n[0-1]: exit 3, lost n1: "
                      f"restart {n} of 2 without n1\n" for n in (1, 2))
    result, calls = _run_stubbed(tmp_path, Batch(max_restarts=2),
                                 'mkdir -p run; echo "75 preempted" > run/exit-status; exit 1',
                                 log=used_up)
    assert result.returncode == 0, result.stderr
    assert calls == ["requeue 4242"]
    assert _endings(tmp_path)[-1] == "exit 75 (preempted): requeue"


def test_no_run_directory_on_this_host_means_no_log_and_no_requeue(tmp_path):
    """The ranks wrote to a run directory inside their container that this host lacks."""
    result, calls = _run_stubbed(tmp_path, Batch(), "exit 3")
    assert result.returncode == 3, result.stderr
    assert calls == [] and not (tmp_path / "run").exists()


def test_an_unwritable_log_means_no_requeue(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "attempts.log").mkdir()  # cannot be appended to
    result, calls = _run_stubbed(tmp_path, Batch(), f"{LOST}; exit 1", lost="n1")
    assert result.returncode == 3, result.stderr
    assert calls == []


#: a crashed rank's record (launcher.faults.rank_record): its node, then faulthandler's traceback
CRASHED = ("{node}\nFatal Python error: Segmentation fault\n\n"
           "Thread 0x7f (most recent call first):\n")


def _left_records(*records: tuple[int, str, bool, int]) -> str:
    """An srun stub body that leaves rank records (rank, node, crashed, seconds ago) in
    run/ranks, as ranks that did not end through Python would, and exits 139."""
    lines = ["mkdir -p run/ranks"]
    for rank, node, crashed, ago in records:
        text = CRASHED.format(node=node) if crashed else f"{node}\n"
        lines += [f"printf '{text}' > run/ranks/{rank}",
                  f'touch -d "@$(( $(date +%s) - {ago} ))" run/ranks/{rank}']
    return "\n".join([*lines, "exit 139"])


@pytest.mark.parametrize(("records", "lost"), [
    # the survivor crashed in MPI after its peer was killed: the peer's node is lost
    (((0, "n0", True, 0), (1, "n1", False, 1)), "n1"),
    # a survivor that hung was ended by srun's --wait 60 s after its peer went quiet
    (((0, "n0", False, 0), (1, "n1", False, 60)), "n1"),
    # a rank crashed first, its peer was ended later: nobody was lost
    (((0, "n0", True, 60), (1, "n1", False, 0)), ""),
    # every rank ended at once (scancel, the time limit, the launcher): nobody can tell
    (((0, "n0", False, 0), (1, "n1", False, 1)), ""),
])
def test_ranks_that_ended_first_without_a_word_name_the_lost_nodes(tmp_path, records, lost):
    result, calls = _run_stubbed(tmp_path, Batch(), _left_records(*records))
    if lost:
        assert result.returncode == 0, result.stderr
        assert calls[-1] == f"update JobId=4242 ExcNodeList={lost}"
        assert _endings(tmp_path) == [f"exit 3, lost {lost}: restart 1 of 3 without {lost}"]
        assert f"the ranks on {lost} ended first without a word" in result.stderr
    else:
        assert result.returncode == 139 and calls == [], result.stderr
        assert _endings(tmp_path) == ["exit 139: passed on"]
    crashed = [f"job 4242: rank {rank} on {node}: Fatal Python error: Segmentation fault "
               f"(traceback: run/ranks/{rank})" for rank, node, crash, _ in records if crash]
    assert [line for line in result.stderr.splitlines() if "Fatal" in line] == crashed


def test_a_status_file_outweighs_the_records(tmp_path):
    srun = _left_records((1, "n1", False, 60)).replace("exit 139", f"{LOST}; exit 139")
    result, calls = _run_stubbed(tmp_path, Batch(), srun, lost="n0")
    assert calls[-1] == "update JobId=4242 ExcNodeList=n0", result.stderr


def test_a_hang_passes_on_without_requeue_whatever_the_records(tmp_path):
    """Exit 4 (launcher.faults.hang_watch): ranks that did not meet, a bug in the script; the
    ranks it ended leave their records, which must not name a lost node."""
    hung = 'mkdir -p run; echo "4 hang: rank 1 (n1) is in barrier #4" > run/exit-status'
    srun = _left_records((1, "n1", False, 60)).replace("exit 139", f"{hung}; exit 137")
    result, calls = _run_stubbed(tmp_path, Batch(), srun)
    assert result.returncode == EXIT_HUNG, result.stderr
    assert calls == [] and _endings(tmp_path) == ["exit 4: passed on"], result.stderr


def test_records_of_an_earlier_attempt_are_removed(tmp_path):
    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "ranks" / "1").write_text("n1\n")
    result, calls = _run_stubbed(tmp_path, Batch(), "exit 1")
    assert result.returncode == 1 and calls == [], result.stderr
    assert not (tmp_path / "run" / "ranks").exists()


@pytest.mark.parametrize(("slow", "max_restarts", "requeued"), [
    ("n2", 3, True), ("", 3, False), ("n2", 0, False)])
def test_preflight_excludes_the_slow_nodes(tmp_path, slow, max_restarts, requeued):
    srun = f"""case "$*" in
*--preflight*) mkdir -p run; printf "{slow}" > run/slow-nodes ;;
*) touch trained ;;
esac"""
    batch = Batch(preflight=True, max_restarts=max_restarts)
    result, calls = _run_stubbed(tmp_path, batch, srun)
    assert result.returncode == 0, result.stderr
    preflight, *train = (tmp_path / "srun").read_text().splitlines()
    assert preflight.endswith("python -m launcher.check --preflight --slow-nodes run/slow-nodes")
    assert (tmp_path / "trained").exists() is not requeued
    assert calls == (["show job 4242", "requeue 4242", "update JobId=4242 ExcNodeList=n2"]
                     if requeued else [])
    if requeued:
        assert _endings(tmp_path) == ["preflight named slow nodes: restart 1 of 3 without n2"]
    else:
        assert train and _endings(tmp_path)[-1] == "exit 0: passed on"


def test_a_failed_preflight_ends_the_job(tmp_path):
    (tmp_path / "run").mkdir()
    result, calls = _run_stubbed(tmp_path, Batch(preflight=True), "exit 2")
    assert result.returncode == 2 and calls == []
    assert len((tmp_path / "srun").read_text().splitlines()) == 1
    assert _endings(tmp_path) == ["preflight failed: exit 2: passed on"]


def test_a_node_range_runs_the_step_on_the_nodes_given(tmp_path):
    result, _ = _run_stubbed(tmp_path, Batch(max_nodes=3), "exit 0")
    assert result.returncode == 0
    assert "#SBATCH --nodes=2-3\n#SBATCH --mincpus=1\n" in (tmp_path / "job.sh").read_text()
    assert (tmp_path / "srun").read_text().startswith("--nodes 2 --ntasks-per-node 1 ")


# -- the script as text -----------------------------------------------------------------------

#: a node range and a preflight, from the builder (docs/launching.md shows what `invoke sbatch`
#: writes for it: tests/test_doc_commands.py)
RANGE_LAUNCH = Launch(nodes=2, procs_per_node=2, launcher="srun", runtime="apptainer",
                      args=("--epochs", "3", "--resume", "auto"))
RANGE_BATCH = Batch(max_nodes=3, preflight=True)


def test_range_and_preflight_golden():
    golden("sbatch_range_preflight.sh", batch_script(RANGE_LAUNCH, RANGE_BATCH))


@pytest.mark.parametrize(("launch", "batch"), [
    (RANGE_LAUNCH, RANGE_BATCH),
    (Launch(launcher="srun", module="torch.distributed.run",
            args=("--nproc-per-node", "2", "-m", "launcher.train")), Batch()),
    (Launch(launcher="srun", module="mine"), Batch(max_nodes=4)),
])
def test_every_variant_is_shellcheck_clean(tmp_path, launch, batch):
    if not shutil.which("shellcheck"):
        missing("shellcheck is not installed (Debian: apt-get install shellcheck)")
    script = tmp_path / "job.sh"
    script.write_text(batch_script(launch, batch))
    result = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


def test_torchrun_of_launcher_train_reads_the_run_directory():
    launch = Launch(launcher="srun", module="torch.distributed.run",
                    args=("-m", "launcher.train", "--run-dir", "/scratch/r"))
    assert "lost_file=/scratch/r/lost-nodes\n" in batch_script(launch, Batch())


@pytest.mark.parametrize(("batch", "message"), [
    (Batch(max_restarts=-1), "--max-restarts -1 is negative"),
    (Batch(max_nodes=1), "--nodes 2-1: the range is empty"),
])
def test_bad_settings_are_refused(batch, message):
    with pytest.raises(LaunchError, match=message):
        batch_script(STUBBED, batch)


def test_preflight_needs_launcher_train():
    with pytest.raises(LaunchError, match="--preflight runs before launcher.train"):
        batch_script(Launch(launcher="srun", module="mine"), Batch(preflight=True))


@pytest.mark.parametrize(("text", "expected"), [("2", (2, 0)), ("2-3", (2, 3)), (" 4 - 8", (4, 8))])
def test_node_range(text, expected):
    assert node_range(text) == expected


@pytest.mark.parametrize("text", ["", "2-", "two", "2-3-4"])
def test_node_range_refuses_what_it_cannot_read(text):
    with pytest.raises(LaunchError, match="is neither a count nor a range"):
        node_range(text)
