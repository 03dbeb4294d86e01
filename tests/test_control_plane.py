"""16 ranks of ``launcher.training.train`` on simulated nodes: the survivors name exactly the ranks
that went silent (one stopped; one killed with a whole node), within ``--timeout-s`` + 10 s,
though each rank only hears its two watched peers (``launcher.faults.watch``): the watchers' word
reaches every rank over the side channel (``launcher.faults.side_channel``).

Plain processes with torchrun's variables (gloo): four simulated nodes of four ranks each
(``GROUP_RANK`` and ``DDP_HOSTS``), and every survivor's own exit status and words can be read.
Under mpiexec (the mpi backend) Hydra ends every rank once one exits, so there the first
survivor's words are checked. Slow on a 2-core machine (16 interpreters): few cases.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

import pytest

from launcher.core.errors import EXIT_PEER_LOST
from launcher.placement.ports import free_port
from tests.fixtures.mpi import REPO_ROOT, clean_environ, end_job, mpiexec_path
from tests.test_stuck_rank import _pid_of_rank, _train, _wait_until_training

WORLD, PER_NODE = 16, 4
#: --timeout-s, as in issue #35's acceptance: 16 interpreters starting on 2 shared cores need
#: more than 5 s to meet
TIMEOUT_S = 30
#: 16 interpreters importing torch on 2 shared cores: minutes under load
STARTUP_S = 400
#: one after another, on the worker of the 3-node Slurm tests: two 16-rank jobs side by side
#: missed their rendezvous, and MPI jobs under srun beside them failed in MPI_Init (PMI-2)
pytestmark = pytest.mark.xdist_group("slurm3")
NODES = [f"sim{node}" for node in range(WORLD // PER_NODE)]
#: the bound the survivors must end within, after the collective timeout
GRACE_S = 10
#: stopping ranks: SIGSTOP (alive, silent) or SIGKILL (gone). One job kills a rank of sim1 and
#: every rank of sim2 at once: rank 6's watchers are 11 (killed with it) and 0, so the node's
#: loss also takes one of the two watchers of a rank elsewhere
CASES = {
    "one-stopped": (signal.SIGSTOP, [5]),
    "one-and-a-node-killed": (signal.SIGKILL, [6, 8, 9, 10, 11]),
}


def _named(stderr: str) -> set[int]:
    found = re.search(r"no heartbeat for \d+ s from (.*)", stderr)
    return {int(rank) for rank in re.findall(r"rank (\d+) \(", found[1])} if found else set()


@pytest.mark.parametrize("case", CASES)
def test_gloo_survivors_name_exactly_the_silent_ranks(tmp_path, case, monkeypatch):
    monkeypatch.setattr("tests.test_stuck_rank.TIMEOUT_S", TIMEOUT_S)
    how, victims = CASES[case]
    port = free_port()
    ranks = [subprocess.Popen(
        _train("gloo", tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO_ROOT, env=clean_environ({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_NODE),
            "LOCAL_WORLD_SIZE": str(PER_NODE), "GROUP_RANK": str(rank // PER_NODE),
            "DDP_HOSTS": ",".join(NODES), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)})) for rank in range(WORLD)]
    try:
        _wait_until_training(ranks[0], STARTUP_S)
        for victim in victims:
            ranks[victim].send_signal(how)
        stopped_at = time.monotonic()
        for rank, process in enumerate(ranks):
            if rank in victims:
                continue
            _, stderr = process.communicate(timeout=TIMEOUT_S + GRACE_S + 60)
            assert process.returncode == EXIT_PEER_LOST, stderr
            assert time.monotonic() - stopped_at < TIMEOUT_S + GRACE_S, stderr
            assert _named(stderr) == set(victims), stderr
            for victim in victims:
                assert f"rank {victim} ({NODES[victim // PER_NODE]})" in stderr, stderr
    finally:
        for process in ranks:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.communicate()


def test_mpi_survivor_names_the_stopped_rank_of_16(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.test_stuck_rank.TIMEOUT_S", TIMEOUT_S)
    tag, victim = f"{os.getpid()}-16", 5
    process = subprocess.Popen(
        [str(mpiexec_path()), "-n", str(WORLD), *_train("mpi", tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env=clean_environ({"DDP_TEST_TAG": tag}), start_new_session=True)
    stopped = None
    try:
        _wait_until_training(process, STARTUP_S)
        stopped = _pid_of_rank(tag, victim, "PMI_RANK")
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = process.communicate(timeout=TIMEOUT_S + GRACE_S + 60)
        assert process.returncode == EXIT_PEER_LOST, stderr
        assert time.monotonic() - stopped_at < TIMEOUT_S + GRACE_S, stderr
        assert _named(stderr) == {victim}, stderr
    finally:
        end_job(process, stopped)
