"""Process-group decisions that need no GPU: which ranks share a GPU (over a real TCPStore),
a clean exit after DDP, torch's DETAIL debug level, and the nodes the mpi backend counts, under
real mpiexec."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.core.errors import EXIT_USER_ERROR
from launcher.group import debug_level
from launcher.group.gpu_sharing import shared_gpu
from launcher.placement.env import JobEnv
from launcher.placement.ports import free_port
from tests.fixtures.mpi import json_objects, run_mpi


def _env(rank: int, world_size: int, host: str, local_rank: int, port: int) -> JobEnv:
    return JobEnv(launcher="hydra", rank=rank, world_size=world_size, local_rank=local_rank,
                  local_world_size=2, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                  master_port=port, hostname=host)


def _run(placements: list[tuple[str, int, str]]) -> list[str | None]:
    """Every rank (a thread with its own client of one TCPStore) calls shared_gpu;
    ``placements`` gives each rank's (host, local rank, GPU identity)."""
    port, size = free_port(), len(placements)

    def rank(r: int) -> str | None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=r == 0,
                              timeout=timedelta(seconds=20))
        host, local_rank, gpu = placements[r]
        answer = shared_gpu(_env(r, size, host, local_rank, port), store, gpu)
        if store.add("done", 1) == size:
            store.set("all-done", "1")
        if r == 0:  # the master's store must outlive the others' last reads
            store.wait(["all-done"])
        return answer

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(rank, range(size)))


def test_ranks_with_their_own_gpus_share_nothing():
    # per-task binding (srun --gpus-per-task=1): every rank sees its GPU as device 0, yet
    # the identities differ
    assert _run([("n0", 0, "GPU-a"), ("n0", 1, "GPU-b"), ("n1", 0, "GPU-a"),
                 ("n1", 1, "GPU-b")]) == [None] * 4


def _conflict(a: int, b: int, host: str, gpu: str) -> str:
    return f"local ranks {a} and {b} on {host} were given the same GPU ({gpu})"


@pytest.mark.parametrize("placements, conflicts", [
    # two hosts; on n1 both ranks were given GPU-c
    ([("n0", 0, "GPU-a"), ("n0", 1, "GPU-b"), ("n1", 0, "GPU-c"), ("n1", 1, "GPU-c")],
     {_conflict(0, 1, "n1", "GPU-c")}),
    # one host, four ranks, two GPUs: two conflicts, whichever is recorded first is reported
    ([("n0", 0, "GPU-a"), ("n0", 1, "GPU-a"), ("n0", 2, "GPU-b"), ("n0", 3, "GPU-b")],
     {_conflict(0, 1, "n0", "GPU-a"), _conflict(2, 3, "n0", "GPU-b")}),
])
def test_a_shared_gpu_is_reported_alike_on_every_rank(placements, conflicts):
    answers = _run(placements)
    assert len(set(answers)) == 1 and answers[0] in conflicts, answers


# DDP used inside process_group, the way launcher.train does, ending well or with a LaunchError
DDP_THEN_EXIT = """
import glob, os, sys, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from launcher.faults.agreement import agree
from launcher.placement.env import detect_environment
from launcher.core.errors import LaunchError, report_and_exit
from launcher.group.process_group import process_group
env = detect_environment()
def work():
    model = DDP(torch.nn.Linear(10, 10))
    model(torch.randn(4, 10)).sum().backward()
    if sys.argv[1] == "fail":
        with agree():  # an error every rank raises together: the group is torn down in order
            raise LaunchError("planned failure", hint="none")
def gloo_threads_left():
    names = (open(task + "/comm").read().strip() for task in glob.glob("/proc/self/task/*"))
    # one write: the ranks share mpiexec's stdout, and print() writes piece by piece
    os.write(1, f"gloo threads left: {sorted(n for n in names if 'gloo' in n)}\\n".encode())
try:
    with process_group(env, "gloo", 60):
        work()
except LaunchError as error:
    gloo_threads_left()
    report_and_exit(error, env.rank)
gloo_threads_left()
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ending, status", [("ok", 0), ("fail", EXIT_USER_ERROR)])
def test_ddp_is_released_before_the_group_so_exit_is_clean(ending, status):
    """A gloo group that outlived process_group aborted the process now and then in the
    interpreter's teardown (SIGABRT, "terminate called without an active exception"): kept
    alive by a DDP reducer in a failure's traceback or in a reference cycle (5 and 7 exits in
    25 for these two programs), or by torch.distributed.nn.functional imported (by DDP) after
    the group existed (once in some hundreds of launcher.train runs). Whether the group is
    really gone is checked directly, so one run says it: its threads must have ended when
    process_group returns (a group kept alive keeps them, every time)."""
    result = run_mpi(2, ["-c", DDP_THEN_EXIT, ending], timeout=60)
    assert result.returncode == status, result.output
    assert "terminate called" not in result.stderr, result.output
    assert result.stdout.count("gloo threads left: []") == 2, result.output


# the default group's class, torch's level and what the launcher recorded, after a collective
DEBUG_DETAIL = """
import json, sys, torch, torch.distributed as dist, launcher
from launcher.placement import settings
with launcher.distributed(backend=sys.argv[1], timeout_s=20) as job:
    total = torch.ones(2)
    dist.all_reduce(total)
    wrapped = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    print(json.dumps({"sum": total.tolist(), "class": type(wrapped).__name__,
                      "level": str(dist.get_debug_level()), "set": settings.applied()}))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend, wrapped, level", [
    ("gloo", "_ProcessGroupWrapper", "DETAIL"), ("mpi", "Backend", "INFO")])
def test_detail_debugging_is_said_once_and_never_breaks_the_mpi_backend(backend, wrapped,
                                                                        level):
    """At DETAIL torch's checks need a store the ranks share: the mpi backend's group waited
    20 s for a gloo group that could never meet ("Wait timeout"); now it runs at INFO."""
    result = run_mpi(2, ["-c", DEBUG_DETAIL, backend], timeout=60,
                     env={debug_level.VARIABLE: "DETAIL"})
    assert result.returncode == 0, result.output
    reports = json_objects(result.stdout)  # print() may write a line in two pieces
    assert len(reports) == 2 and all(r["sum"] == [2.0, 2.0] for r in reports), result.output
    assert {(r["class"], r["level"]) for r in reports} == {(wrapped, f"DebugLevel.{level}")}
    recorded = [s for s in reports[0]["set"] if s["name"] == debug_level.VARIABLE]
    assert [s["value"] for s in recorded] == ([] if level == "DETAIL" else ["INFO"])
    assert result.stderr.count(f"warning: {debug_level.VARIABLE}=DETAIL") == 1, result.output


# 3 ranks on host "a", rank 3 alone on "b", as mpiexec with a machinefile "a:3 b:1" places them;
# each rank is told its own host's local rank and size, as Hydra tells them
UNEVEN_NODES = """
import json, os, sys
from launcher.group.process_group import process_group
from launcher.placement.env import detect_environment
rank = int(os.environ["PMI_RANK"])
local = {"MPI_LOCALRANKID": str(rank % 3), "MPI_LOCALNRANKS": "3"} if rank < 3 else {
    "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
env = detect_environment({**os.environ, **local}, hostname="a" if rank < 3 else "b")
with process_group(env, sys.argv[1], 30) as context:
    print(json.dumps({"rank": rank, "backend": context.backend, "hosts": context.env.hosts,
                      "node": [context.env.node_rank, context.env.num_nodes]}), flush=True)
"""


@pytest.mark.mpi
def test_the_mpi_backend_counts_the_nodes_of_uneven_hosts_alike():
    """The mpi backend starts no store, where the node index used to be corrected: rank 3, alone
    on its host, said node 3 of 4 while rank 0 said node 0 of 2 (Job.node_rank, num_nodes)."""
    result = run_mpi(4, ["-c", UNEVEN_NODES, "mpi"], timeout=90)
    assert result.returncode == 0, result.output
    records = sorted(json_objects(result.stdout), key=lambda record: record["rank"])
    assert [(r["rank"], r["hosts"], r["node"]) for r in records] == [
        (0, ["a", "b"], [0, 2]), (1, ["a", "b"], [0, 2]), (2, ["a", "b"], [0, 2]),
        (3, ["a", "b"], [1, 2])], result.output
    assert all(r["backend"].startswith("mpi") for r in records), result.output  # no store
