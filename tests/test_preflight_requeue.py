"""A bad node found first, for real: the batch script of ``invoke sbatch`` runs
``launcher.check --preflight`` on the 3-node Slurm of ``tests.fixtures.slurm``, with one node
slowed in a cgroup, and requeues the job without it before training starts. The job and the
script are tests/test_requeue.py's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddp_tasks.local_slurm import TERMINAL_STATES
from tests.fixtures.cpu_groups import join, outweighing_group
from tests.test_batch_endings import attempts
from tests.test_requeue import (
    _batch,
    _submit,
    _train_on_two_nodes,
    shm_unchanged,  # noqa: F401 (a fixture)
)


@pytest.mark.slurm
def test_preflight_leaves_a_slow_node_out(slurm_cluster3, tmp_path, shm_unchanged):  # noqa: F811
    """n2 at a tenth of a CPU (its slurmd's group, tests.fixtures.cpu_groups): the preflight
    of the first attempt names it, and the script requeues the job without it. The requeued
    attempt is not waited for: on a loaded 2-core machine the preflight may also name a
    healthy node (a link measured while others ran), and with two nodes excluded the 2-node
    job would stay pending."""
    launch = _train_on_two_nodes(tmp_path, "gloo")
    batch = _batch(tmp_path, "preflight", max_nodes=3, preflight=True)
    with outweighing_group(f"ddp-test-slow-{os.getpid()}") as nodes:
        for node in ("n0", "n1", "n2"):
            join(nodes / node, slurm_cluster3.slurmd_pid(node),
                 cpus=0.1 if node == "n2" else None)
        try:
            job_id = _submit(slurm_cluster3, tmp_path, launch, batch)
            excluded = _wait_for_excluded_nodes(slurm_cluster3, job_id, tmp_path)
        finally:
            # before the groups go, so that their members have ended; and a failed test leaves
            # no job behind (in a cold run of 2026-11-28 the requeued attempt ran on)
            slurm_cluster3.cancel_all()
    output = next(tmp_path.glob("job-*.out")).read_text()
    ((nodes, ending),) = attempts(tmp_path / "run")
    assert nodes == "n[0-2]", output
    named = ending.removeprefix("preflight named slow nodes: restart 1 of 3 without ")
    assert "n2" in named.split(","), output
    hostnames = slurm_cluster3.scontrol(["show", "hostnames", excluded]).split()
    assert sorted(hostnames) == sorted(named.split(",")), (excluded, named)
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "trained on a slow node"
    # the side channel's last beats are read before MPI_Finalize (side_mpi.close), else UCX
    # reports each one unread on its way out (8 lines here before)
    assert "unexpected tag-receive" not in output, output


def _wait_for_excluded_nodes(cluster, job_id: int, tmp_path: Path) -> str:
    """The nodes the batch script excluded when it requeued the job after its preflight.

    A job held back (by a node the last test's job still held when the scheduler looked) is
    not the preflight's time: the clock starts when it runs. The CI of 2026-11-28 ran out of
    the 180 s it had from the submission with the preflight's ranks still starting MPI; when
    the job started was not recorded, and is now."""
    # pending again once it has run: requeued
    _poll_job(cluster, job_id, tmp_path, 120,
              lambda fields: fields["JobState"] != "PENDING" or fields["Restarts"] != "0")
    # the script logs, requeues, then sets the excluded nodes; a preflight that named nobody
    # goes on to train, and one that failed ends the job; ~20 s alone, and generous for a
    # loaded run, since every failure ends the wait at once
    trained = tmp_path / "run" / "metrics.jsonl"
    fields = _poll_job(cluster, job_id, tmp_path, 300, lambda fields: (
        fields["ExcNodeList"] != "(null)" or fields["JobState"] in TERMINAL_STATES
        or trained.exists()))
    assert fields["ExcNodeList"] != "(null)", _job_story(cluster, job_id, tmp_path)
    return fields["ExcNodeList"]


def _poll_job(cluster, job_id: int, tmp_path: Path, timeout: float,
              done: Callable[[dict[str, str]], bool]) -> dict[str, str]:
    """The job's fields once ``done`` holds for them; a failure with its story at the
    timeout."""
    deadline = time.monotonic() + timeout
    while not done(fields := cluster.job_fields(job_id)):
        assert time.monotonic() < deadline, _job_story(cluster, job_id, tmp_path)
        time.sleep(0.5)
    return fields


def _job_story(cluster, job_id: int, tmp_path: Path) -> str:
    """What a test that stops waiting shows: the job's state and its output so far."""
    fields = cluster.job_fields(job_id)
    state = " ".join(f"{key}={fields.get(key)}" for key in (
        "JobState", "Reason", "NodeList", "SubmitTime", "StartTime", "RunTime", "Restarts",
        "ExcNodeList"))
    outputs = [path.read_text(errors="replace")[-4000:] for path in tmp_path.glob("job-*.out")]
    return f"job {job_id}: {state}\n" + "\n".join(outputs)
