"""The compose Slurm cluster: srun across 2 nodes, and sbatch's preempt -> requeue -> resume.

The commands are the user's: ``invoke run --launcher srun --dry-run`` and ``invoke sbatch``
write them on the host, and they run on the controller container (the login node).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.fixtures.cluster import Cluster, param_hashes
from tests.fixtures.mpi import REPO_ROOT, json_objects

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slurm]

LOGIN = "slurmctld"
NODES, PER_NODE = 2, 2
JOB_TIMEOUT = 300  # seconds for one job on a shared 2-core machine
#: long enough that the preemption signal lands mid-run (4 ranks: 22 steps an epoch)
TRAIN = "--epochs 12 --checkpoint-every 10 --log-every 10"


def invoke(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True, timeout=60).stdout


def srun_command(module: str, args: str = "") -> str:
    return invoke("run", "--launcher", "srun", "--runtime", "none", "--nodes", str(NODES),
                  "--procs-per-node", str(PER_NODE), "--module", module, "--args", args,
                  "--dry-run")


def job(cluster: Cluster, job_id: str) -> dict[str, str]:
    text = cluster.check(LOGIN, f"scontrol show job {job_id} -o")
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for_job(cluster: Cluster, job_id: str, states: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (record := job(cluster, job_id))["JobState"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} not in {states} after {timeout} s: " \
                                            f"{record}"
        time.sleep(1)
    return record


def submit(cluster: Cluster, tmp_path, name: str, args: str) -> str:
    """Write the batch script with ``invoke sbatch``, put it in /shared, sbatch it; job id."""
    script = tmp_path / f"{name}.sbatch"
    invoke("sbatch", "--runtime", "none", "--nodes", str(NODES), "--procs-per-node",
           str(PER_NODE), "--job-name", name, "--args", args, "--output", "/shared/%x-%j.out",
           "--script", str(script))
    cluster.exec(LOGIN, f"cat > /shared/{name}.sbatch", stdin=script.read_text())
    return cluster.check(LOGIN, f"sbatch --parsable /shared/{name}.sbatch").strip().split(";")[0]


def test_srun_check_places_ranks_by_slurm_variables(compose_slurm):
    forms = compose_slurm.check(
        LOGIN, f"srun -N {NODES} --ntasks-per-node {PER_NODE} sh -c "
        "'echo $SLURM_JOB_NODELIST $SLURM_TASKS_PER_NODE $SLURM_NODEID' | sort -u")
    assert forms.split("\n")[:2] == ["node[0-1] 2(x2) 0", "node[0-1] 2(x2) 1"], forms

    output = compose_slurm.check(LOGIN, srun_command("launcher.check", "--json"),
                                 timeout=JOB_TIMEOUT)
    reports = sorted((rank for obj in json_objects(output) for rank in obj.get("ranks", ())),
                     key=lambda report: report["rank"])
    places = [(r["rank"], r["host"], r["node_rank"], r["local_rank"]) for r in reports]
    assert places == [(0, "node0", 0, 0), (1, "node0", 0, 1),
                      (2, "node1", 1, 0), (3, "node1", 1, 1)], output


def test_srun_train_gives_one_model_on_every_rank(compose_slurm):
    output = compose_slurm.check(
        LOGIN, srun_command("launcher.train", "--epochs 1 --run-dir /shared/runs/srun"),
        timeout=JOB_TIMEOUT)
    hashes = param_hashes(output)
    assert sorted(hashes) == list(range(NODES * PER_NODE)), output
    assert len(set(hashes.values())) == 1, hashes


def test_sbatch_preempted_job_requeues_and_resumes_to_the_same_model(compose_slurm, tmp_path):
    reference = submit(compose_slurm, tmp_path, "whole", f"{TRAIN} --run-dir /shared/runs/whole")
    assert wait_for_job(compose_slurm, reference, {"COMPLETED", "FAILED"},
                        JOB_TIMEOUT)["JobState"] == "COMPLETED"
    expected = param_hashes(compose_slurm.check(LOGIN, f"cat /shared/whole-{reference}.out"))
    assert len(expected) == NODES * PER_NODE and len(set(expected.values())) == 1, expected

    run_dir = "/shared/runs/preempted"
    job_id = submit(compose_slurm, tmp_path, "preempted", f"{TRAIN} --run-dir {run_dir}")
    deadline = time.monotonic() + JOB_TIMEOUT
    while compose_slurm.exec(LOGIN, f"ls {run_dir}/checkpoints/ckpt-*.pt").returncode != 0:
        assert job(compose_slurm, job_id)["JobState"] in {"PENDING", "RUNNING"}
        assert time.monotonic() < deadline, "the job saved no checkpoint"
        time.sleep(0.5)
    # what Slurm does --signal-seconds before the time limit, now: USR1 to every task
    compose_slurm.check(LOGIN, f"scancel --signal=USR1 {job_id}")
    record = wait_for_job(compose_slurm, job_id, {"PENDING", "COMPLETED", "FAILED"}, JOB_TIMEOUT)
    assert record["JobState"] == "PENDING" and record["Restarts"] == "1", record
    # Slurm holds a requeued job back (Reason=BeginTime, once its scheduler has passed over it:
    # "None" before, seen on a loaded machine) until the old run's credential has expired on
    # the nodes (AuthInfo=cred_expire=30 in docker/slurm/slurm.conf). Not lifted with
    # `scontrol update StartTime=now`: on a loaded machine the old run's clean-up then races
    # the new run of the same job id, which ended FAILED with no output of its own.
    record = wait_for_job(compose_slurm, job_id, {"COMPLETED", "FAILED"}, JOB_TIMEOUT)
    output = compose_slurm.check(LOGIN, f"cat /shared/preempted-{job_id}.out")
    assert record["JobState"] == "COMPLETED", output
    assert f"job {job_id} preempted (exit 75): requeueing" in output
    assert re.search(r"resuming from \S+ckpt-\d+\.pt \(step [1-9]", output), output
    assert param_hashes(output) == expected, output
