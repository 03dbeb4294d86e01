"""A sweep on the real Slurm fixture: ``invoke sbatch --sweep ... --submit`` submits one array
job of three tasks; one task is preempted with SIGUSR1, requeued alone, and all three finish
with their own accuracies, which ``invoke sweep-summary`` tabulates.

The preempted task is the one whose job id is the array's own (Slurm keeps that id for one
task): a script that requeued ``$SLURM_JOB_ID`` there would requeue every task of the array.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.mpi import REPO_ROOT, json_objects
from tests.fixtures.tasks_cli import invoke, on_path
from tests.test_requeue import shm_unchanged  # noqa: F401 (a fixture)

LRS = ("0.1", "0.05", "0.02")
#: digits, quick, checkpoints every 10 steps so that the requeued task resumes mid-run
TRAIN = "--epochs 3 --global-batch-size 48 --checkpoint-every 10 --log-every 5 --timeout-s 30"
#: three tasks of two ranks on two cores, a requeue hold (cred_expire=30 + 1 s) and a resume
JOB_TIMEOUT = 480


def _tasks(cluster, array_id: int) -> dict[int, dict[str, str]]:
    """``scontrol show job -o`` of each task of the array, by task id (pending ones too)."""
    fields = {}
    for line in cluster.scontrol(["show", "job", "-o", str(array_id)]).splitlines():
        job = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if re.fullmatch(r"\d+", job.get("ArrayTaskId", "")):
            fields[int(job["ArrayTaskId"])] = job
    return fields


def _wait_for_checkpoint(cluster, run_dir: Path, array_id: int, task: int) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT / 2
    while not list((run_dir / "checkpoints").glob("ckpt-*.pt")):
        state = _tasks(cluster, array_id).get(task, {}).get("JobState")
        assert state in {"PENDING", "RUNNING"}, f"task {task} is {state} before a checkpoint"
        assert time.monotonic() < deadline, f"task {task} saved no checkpoint"
        time.sleep(0.2)


@pytest.mark.slurm
def test_a_sweep_task_preempted_is_requeued_alone(slurm_cluster, tmp_path, shm_unchanged):  # noqa: F811
    root = tmp_path / "sweep"
    env = {"PATH": on_path(Path(sys.executable).parent),
           "PYTHONPATH": str(REPO_ROOT), "SLURM_CONF": str(slurm_cluster.conf)}
    result = invoke("sbatch", "--submit", "--runtime", "none", "--procs-per-node", "2",
                    "--sweep", f"lr={','.join(LRS)}", "--throttle", "3", "--job-name", "sweep",
                    "--time", "00:10:00", "--output", str(tmp_path / "%x-%A_%a.out"),
                    "--script", "sweep.sbatch",
                    "--args", f"{TRAIN} --run-dir {root} --data-dir {tmp_path / 'data'}",
                    cwd=tmp_path, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    array_id = int(result.stdout.splitlines()[-1].removeprefix("submitted job "))
    assert "#SBATCH --array=0-2%3" in (tmp_path / "sweep.sbatch").read_text()

    deadline = time.monotonic() + 60
    while len(tasks := _tasks(slurm_cluster, array_id)) < 3 or any(
            t["JobState"] == "PENDING" for t in tasks.values()):
        assert time.monotonic() < deadline, f"the three tasks never all started: {tasks}"
        time.sleep(0.5)
    # the task that kept the array's id, if Slurm gave it one; else the middle one
    victim = next((i for i, t in tasks.items() if t["JobId"] == str(array_id)), 1)
    victim_dir = root / f"lr={LRS[victim]}"
    _wait_for_checkpoint(slurm_cluster, victim_dir, array_id, victim)
    # what Slurm does --signal-seconds before the time limit, now: USR1 to that task's ranks
    subprocess.run(["scancel", "--signal=USR1", f"{array_id}_{victim}"],
                   env=slurm_cluster.env, check=True, timeout=30)

    for task in range(3):
        finished = slurm_cluster.wait_job(f"{array_id}_{task}", timeout=JOB_TIMEOUT)
        output = (tmp_path / f"sweep-{array_id}_{task}.out").read_text()
        assert (finished.state, finished.exit_code) == ("COMPLETED", "0:0"), output
        restarts = _tasks(slurm_cluster, array_id)[task]["Restarts"]
        assert restarts == ("1" if task == victim else "0"), (task, output)
        preempted = f"job {array_id}_{task} preempted (exit 75): requeueing"
        assert (preempted in output) == (task == victim), output
        assert ("resuming from" in output) == (task == victim), output
    accuracies = {}
    for lr in LRS:
        records = json_objects((root / f"lr={lr}" / "metrics.jsonl").read_text())
        first_step = next(r for r in records if r.get("event") == "step")
        assert abs(first_step["lr"] - float(lr)) < 0.1 * float(lr), first_step  # its own lr
        accuracies[lr] = [r for r in records if r.get("event") == "eval"][-1]["test_accuracy"]
    assert len(set(accuracies.values())) == 3, accuracies

    summary = invoke("sweep-summary", str(root), cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    rows = [line.split() for line in summary.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == sorted(LRS, key=float), summary.stdout
    for lr, *_, accuracy, attempts in rows:
        assert float(accuracy) == pytest.approx(accuracies[lr], abs=1e-4), summary.stdout
        assert attempts == ("2" if lr == LRS[victim] else "1"), summary.stdout
