"""Runs under mpiexec for tests/test_mpi_backend.py; ``argv[1]`` names the scenario.

Every scenario prints one JSON object per rank on stdout ({"rank": r, ...}) and exits 0, or
exits non-zero naming what failed. The gloo group needs MASTER_ADDR/MASTER_PORT (the test picks
a free port). The ``compare`` scenario's cases, every op and dtype against gloo, are in
tests/mpi_backend_cases.py.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.core.errors import LaunchError, report_and_exit
from launcher.mpi import buffers as mpi_buffers
from launcher.mpi import cxx as mpi_cxx
from launcher.mpi import reductions as mpi_reductions
from tests import mpi_backend_cases
from tests.mpi_backend_cases import RANK, SIZE, R, rand

#: the implementation under test (the test sets DDP_MPI_IMPL): its registered backend name
MPI_NAME = mpi_cxx.choose(os.environ.get("DDP_MPI_IMPL", "python")).name
TIMEOUT = datetime.timedelta(seconds=60)


def emit(**fields) -> None:
    print(json.dumps({"rank": RANK, **fields}), flush=True)


def init_default(backend: str, shared_store: bool = False) -> None:
    """mpi4py needs no shared store; gloo groups made later by new_group do (env://)."""
    if backend == "gloo" or shared_store:
        dist.init_process_group(backend, rank=RANK, world_size=SIZE, timeout=TIMEOUT)
    else:
        dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=RANK,
                                world_size=SIZE, timeout=TIMEOUT)


def scenario_compare() -> None:
    """Every op and dtype on gloo and on each implementation of the mpi backend
    (``DDP_TEST_IMPLS``, e.g. ``python,cxx``) in the same processes, one gloo reference for
    all: the first implementation's group is the default one unless argv[2] is
    'gloo-default'; the others are made by new_group."""
    names = [mpi_cxx.choose(impl).name for impl in os.environ["DDP_TEST_IMPLS"].split(",")]
    default = "gloo" if sys.argv[2] == "gloo-default" else names[0]
    init_default(default, shared_store=True)
    groups = {backend: dist.group.WORLD if backend == default else
              dist.new_group(backend=backend, timeout=TIMEOUT) for backend in ["gloo", *names]}
    cases, failures = mpi_backend_cases.compare(groups, names)
    # the Python group's (the compiled one gets the same number from the same call)
    spin = next((g._spin_s for g in groups.values() if hasattr(g, "_spin_s")), None)
    emit(cases=cases, impls=names, failures=failures[:20], failed=len(failures), spin_s=spin)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


def sgd(model: torch.nn.Module, steps: int) -> None:
    """``steps`` of SGD with momentum on MSE, each rank its own random data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + RANK)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def train(backend: str, steps: int) -> str:
    """``steps`` of DDP SGD on a small MLP, each rank its own data; the parameters' sha256."""
    torch.manual_seed(RANK)  # different initial weights: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.register_buffer("step", torch.zeros((), dtype=torch.int64))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    sgd(ddp, steps)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def train_fsdp(steps: int) -> str:
    """``steps`` of SGD on the same MLP sharded by FSDP2 (``fully_shard``: all_gather_into_tensor
    forward, reduce_scatter_tensor backward), each rank its own data; the full weights' sha256."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    sgd(model, steps)
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(full[name].numpy().tobytes())
    return digest.hexdigest()


def scenario_ddp() -> None:
    """50 DDP steps on gloo (argv[2]: steps), then 5 FSDP2 steps; prints the weights' hashes;
    the same on the mpi4py default group.

    gloo first: FSDP's device mesh keeps the gloo group alive past destroy_process_group, and
    a gloo worker thread that drops the last reference to a finished work's tensors once the
    interpreter has begun to finalize dies taking the GIL ("terminate called without an active
    exception", SIGABRT; pytorch#190489): 4 runs in 29 of 3 ranks here, and once in CI, when
    gloo came last (2026-12-03), none in 30 with it first. The mpi half gives those threads
    seconds to let go before the exit."""
    steps = int(sys.argv[2])
    init_default("gloo")
    emit(backend="gloo", digest=train("gloo", steps), fsdp_digest=train_fsdp(5))
    dist.destroy_process_group()
    init_default(MPI_NAME)
    emit(backend="mpi4py", digest=train(MPI_NAME, steps), fsdp_digest=train_fsdp(5),
         thread_level=MPI.Query_thread())
    dist.destroy_process_group()


def scenario_subgroup() -> None:
    """new_group over ranks [0, size-1] with mpi4py, default group mpi4py too."""
    init_default(MPI_NAME)
    members = [0, SIZE - 1]
    sub = dist.new_group(members, timeout=TIMEOUT)
    result = None
    if RANK in members:
        t = torch.tensor([float(RANK + 1)])
        dist.all_reduce(t, group=sub)
        dist.broadcast(t, src=members[-1], group=sub)
        result = t.item()
    t = torch.ones(1)
    dist.all_reduce(t)
    emit(subgroup_sum=result, world_sum=t.item())
    dist.destroy_process_group()


def scenario_threads() -> None:
    """Two threads per rank exchange messages with the next rank at once (distinct tags)."""
    init_default(MPI_NAME)
    nxt, prev = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    errors = []

    def exchange(tag: int) -> None:
        try:
            for i in range(200):
                out = torch.empty(64, dtype=torch.int64)
                works = [dist.irecv(out, src=prev, tag=tag),
                         dist.isend(torch.full((64,), nxt * 1000 + i + tag), dst=nxt, tag=tag)]
                for w in works:
                    w.wait()
                assert torch.equal(out, torch.full((64,), RANK * 1000 + i + tag)), (tag, i)
        except Exception as error:  # noqa: BLE001 - reported through the JSON line
            errors.append(repr(error))

    threads = [threading.Thread(target=exchange, args=(tag,)) for tag in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit(errors=errors, thread_level=MPI.Query_thread())
    dist.destroy_process_group()


def scenario_poll() -> None:
    """Rank 0 receives from any rank, polling is_completed(); the others send their rank."""
    init_default(MPI_NAME)
    if RANK == 0:
        sources = []
        for _ in range(SIZE - 1):
            t = torch.zeros(4, 2)[:, 0]  # non-contiguous: the data arrives at completion
            work = dist.irecv(t)
            while not work.is_completed():
                time.sleep(0.001)
            source = work._source_rank()
            sources.append(source if torch.equal(t, torch.full((4,), float(source))) else -1)
        emit(sources=sorted(sources))
    else:
        dist.send(torch.full((4,), float(RANK)), dst=0)
        emit(sources=None)
    dist.destroy_process_group()


def scenario_cuda() -> None:
    """CUDA tensors (staged through host memory unless MPI is CUDA-aware) vs the same on CPU."""
    init_default(MPI_NAME)
    torch.cuda.set_device(RANK % torch.cuda.device_count())
    gen = torch.Generator().manual_seed(RANK)
    cpu = torch.randn(1000, generator=gen)
    results = {}
    for device in ("cpu", "cuda"):
        t = cpu.to(device, copy=True)  # without copy the cpu pass would reduce `cpu` itself
        dist.all_reduce(t)
        b = cpu.to(device, copy=True)
        dist.broadcast(b, src=0)
        out = torch.empty(1000 * SIZE, device=device)
        dist.all_gather_into_tensor(out, cpu.to(device))
        results[device] = [x.cpu() for x in (t, b, out)]
    same = all(torch.equal(a, b) for a, b in zip(results["cpu"], results["cuda"], strict=True))
    emit(same=same, cuda_aware=mpi_buffers.cuda_aware())
    dist.destroy_process_group()


def set_slice_bytes(n: int) -> None:
    if MPI_NAME == mpi_cxx.BACKEND_NAME:
        mpi_cxx.loaded().set_slice_bytes(n)
    else:
        mpi_reductions.ALLREDUCE_SLICE_BYTES = n


def scenario_sliced() -> None:
    """all_reduce in slices (tiny ones here, and the real 4 MiB ones on a larger tensor) gives
    exactly what one piece gives. Values are small integers, so every sum is exact whatever
    order MPI adds in."""
    init_default(MPI_NAME)
    gen = torch.Generator().manual_seed(RANK)
    mismatches = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool):
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
        if dtype.is_floating_point:
            ops.append(dist.ReduceOp.AVG)
        for op in ops:
            # small integers in every dtype: exact sums, so MPI's order of additions (which
            # MPICH's ring changes with the slice) cannot tell the results apart
            source = rand((1001,), torch.bool if dtype == torch.bool else torch.int64, gen)
            source = source.to(dtype)
            results = []
            for slice_bytes in (1 << 30, 24):
                set_slice_bytes(slice_bytes)
                t = source.clone()
                dist.all_reduce(t, op=op)
                results.append(t)
            if not torch.equal(*results):
                mismatches.append(f"{dtype} {op}")
    set_slice_bytes(4 << 20)
    big = torch.full(((4 << 20) // 4 + 3,), float(RANK + 1))  # 4 MiB and 3 floats: 2 slices
    dist.all_reduce(big)
    emit(mismatches=mismatches, big_ok=bool(torch.all(big == SIZE * (SIZE + 1) / 2)))
    dist.destroy_process_group()


def scenario_bad_world_size() -> None:
    """init_process_group with one rank too many: every rank must say so and exit non-zero."""
    try:
        dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=RANK,
                                world_size=SIZE + 1, timeout=TIMEOUT)
    except LaunchError as error:
        report_and_exit(error, RANK)
    emit(error=None)


def scenario_bad_rank() -> None:
    """Every rank claims rank 0: only the others see a mismatch, yet all must fail together."""
    try:
        dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=0,
                                world_size=SIZE, timeout=TIMEOUT)
    except LaunchError as error:
        report_and_exit(error, RANK)
    emit(error=None)


def scenario_bad_reduce_op() -> None:
    """BAND on float32: a clear error on every rank (no rank reaches the MPI call)."""
    init_default(MPI_NAME)
    try:
        dist.all_reduce(torch.ones(3), op=R.BAND)
    except LaunchError as error:
        report_and_exit(error, RANK)
    emit(error=None)


def scenario_timeout() -> None:
    """The last rank never enters the barrier: the others time out naming the op and exit."""
    dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=RANK,
                            world_size=SIZE, timeout=datetime.timedelta(seconds=2))
    if RANK == SIZE - 1:
        time.sleep(60)  # stuck rank; mpiexec must clean it up when the others abort
        sys.exit(0)
    try:
        dist.barrier()
    except LaunchError as error:
        report_and_exit(error, RANK)
    emit(error=None)


def scenario_ddp_timeout() -> None:
    """The last rank never runs backward: the others' gradient all_reduce inside DDP times out
    and the backend's error comes out of loss.backward(), not a hang."""
    dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=RANK,
                            world_size=SIZE, timeout=datetime.timedelta(seconds=2))
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    if RANK == SIZE - 1:
        time.sleep(60)
        sys.exit(0)
    try:
        ddp(torch.randn(2, 4)).sum().backward()
    except LaunchError as error:  # pybind hands the backend's own exception through autograd
        report_and_exit(error, RANK)
    emit(error=None)


SCENARIOS = {
    "compare": scenario_compare,
    "ddp": scenario_ddp,
    "subgroup": scenario_subgroup,
    "threads": scenario_threads,
    "poll": scenario_poll,
    "cuda": scenario_cuda,
    "sliced": scenario_sliced,
    "bad-world-size": scenario_bad_world_size,
    "bad-rank": scenario_bad_rank,
    "bad-reduce-op": scenario_bad_reduce_op,
    "timeout": scenario_timeout,
    "ddp-timeout": scenario_ddp_timeout,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
