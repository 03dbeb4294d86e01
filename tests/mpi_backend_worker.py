"""Runs under mpiexec for tests/test_mpi_backend.py; ``argv[1]`` names the scenario.

Every scenario prints one JSON object per rank on stdout ({"rank": r, ...}) and exits 0, or
exits non-zero naming what failed. The gloo group needs MASTER_ADDR/MASTER_PORT (the test picks
a free port).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import threading
import time
import zlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from mpi4py import MPI

from launcher.core.errors import LaunchError, report_and_exit
from launcher.mpi import buffers as mpi_buffers
from launcher.mpi import cxx as mpi_cxx
from launcher.mpi import reductions as mpi_reductions

WORLD = MPI.COMM_WORLD
#: the implementation under test (the test sets DDP_MPI_IMPL): its registered backend name
MPI_NAME = mpi_cxx.choose(os.environ.get("DDP_MPI_IMPL", "python")).name
RANK, SIZE = WORLD.rank, WORLD.size
TIMEOUT = datetime.timedelta(seconds=60)
R = dist.ReduceOp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.uint16, torch.uint32, torch.uint64, torch.bool]
# dtypes gloo lacks: gloo computes the reference in 8 bits (values and results are small)
GLOO_PROXY = {torch.int16: torch.int8, torch.uint16: torch.uint8, torch.uint32: torch.uint8,
              torch.uint64: torch.uint8}
# (shape, non-contiguous): a rank's share; ops that split a tensor among ranks scale dim 0
SHAPES = [((0,), False), ((1,), False), ((6, 7), False), ((6, 7), True)]
BIG = ((3 << 18,), False)  # 3 MiB of float32: MPI's large-message protocol


def emit(**fields) -> None:
    print(json.dumps({"rank": RANK, **fields}), flush=True)


def init_default(backend: str, shared_store: bool = False) -> None:
    """mpi4py needs no shared store; gloo groups made later by new_group do (env://)."""
    if backend == "gloo" or shared_store:
        dist.init_process_group(backend, rank=RANK, world_size=SIZE, timeout=TIMEOUT)
    else:
        dist.init_process_group(MPI_NAME, store=dist.HashStore(), rank=RANK,
                                world_size=SIZE, timeout=TIMEOUT)


# -- inputs --------------------------------------------------------------------------------

def rand(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    # |values| <= 4, and small enough that a PRODUCT over every rank fits in 8 bits (GLOO_PROXY)
    bound = min(4, int(127 ** (1 / SIZE)))
    low = -bound if dtype.is_signed else 0
    return torch.randint(low, bound + 1, shape, generator=gen).to(dtype)


def tensor(shape, dtype, noncontig: bool, gen: torch.Generator) -> torch.Tensor:
    """A random tensor; the same values in a strided view (every other element) if
    ``noncontig``."""
    values = rand(shape, dtype, gen)
    if not noncontig:
        return values
    t = torch.empty((*shape, 2), dtype=dtype)[..., 0]
    t.copy_(values)
    assert not t.is_contiguous()
    return t


def empty(shape, dtype, noncontig: bool) -> torch.Tensor:
    """An output tensor filled with a marker, strided like ``tensor``'s."""
    gen = torch.Generator().manual_seed(1234)
    return tensor(shape, dtype, noncontig, gen)


# -- ops: each takes (group, dtype, shape, noncontig, gen) and returns tensors to compare -----

def rows(i: int, j: int) -> int:
    """Uneven all-to-all: rows rank i sends to rank j (symmetric, so j expects the same)."""
    return (i + j) % 3 + 1


def group_rank(group) -> int:
    return dist.get_rank(group)


def gloo_real(g, t: torch.Tensor) -> torch.Tensor:
    """gloo's gather and scatter lack complex dtypes: move the (real, imag) pairs instead."""
    return torch.view_as_real(t) if t.is_complex() and dist.get_backend(g) == "gloo" else t


# The ops each case runs: a function of (group, dtype, shape, non-contiguous, generator)
# returning the tensors to compare; the reductions made per reduce op.
def all_reduce(op):
    def run(g, dt, shape, nc, gen):
        t = tensor(shape, dt, nc, gen)
        dist.all_reduce(t, op=op, group=g)
        return [t]
    return run


def reduce(op):
    def run(g, dt, shape, nc, gen):
        t = tensor(shape, dt, nc, gen)
        root = SIZE - 1
        dist.reduce(t, dst=root, op=op, group=g)
        return [t] if root == RANK else []
    return run


def broadcast(g, dt, shape, nc, gen):
    t = tensor(shape, dt, nc, gen)
    dist.broadcast(t, src=SIZE - 1, group=g)
    return [t]


def all_gather(g, dt, shape, nc, gen):
    outs = [empty(shape, dt, nc) for _ in range(SIZE)]
    dist.all_gather(outs, tensor(shape, dt, nc, gen), group=g)
    return outs


def all_gather_into_tensor(g, dt, shape, nc, gen):
    out = empty((SIZE * shape[0], *shape[1:]), dt, False)
    dist.all_gather_into_tensor(out, tensor(shape, dt, nc, gen), group=g)
    return [out]


def gather(g, dt, shape, nc, gen):
    outs = [empty(shape, dt, nc) for _ in range(SIZE)] if RANK == 0 else []
    dist.gather(gloo_real(g, tensor(shape, dt, nc, gen)),
                [gloo_real(g, t) for t in outs] or None, dst=0, group=g)
    return outs


def scatter(g, dt, shape, nc, gen):
    ins = [gloo_real(g, tensor(shape, dt, nc, gen)) for _ in range(SIZE)] if RANK == 0 else None
    out = empty(shape, dt, nc)
    dist.scatter(gloo_real(g, out), ins, src=0, group=g)
    return [out]


def reduce_scatter(op):
    def run(g, dt, shape, nc, gen):
        out = empty(shape, dt, nc)
        dist.reduce_scatter(out, [tensor(shape, dt, nc, gen) for _ in range(SIZE)], op=op,
                            group=g)
        return [out]
    return run


def reduce_scatter_tensor(op):
    def run(g, dt, shape, nc, gen):
        out = empty(shape, dt, False)
        inp = tensor((SIZE * shape[0], *shape[1:]), dt, nc, gen)
        dist.reduce_scatter_tensor(out, inp, op=op, group=g)
        return [out]
    return run


def all_to_all(g, dt, shape, nc, gen):
    # equal sizes: gloo's list form has no uneven splits (all_to_all_single_uneven has)
    ins = [tensor(shape, dt, nc, gen) for _ in range(SIZE)]
    outs = [empty(shape, dt, nc) for _ in range(SIZE)]
    dist.all_to_all(outs, ins, group=g)
    return outs


def all_to_all_single(g, dt, shape, nc, gen):
    shape = (SIZE * shape[0], *shape[1:])
    out = empty(shape, dt, False)
    dist.all_to_all_single(out, tensor(shape, dt, nc, gen), group=g)
    return [out]


def all_to_all_single_uneven(g, dt, shape, nc, gen):
    width = shape[-1] if len(shape) > 1 else 1
    splits = [rows(RANK, j) for j in range(SIZE)]
    inp = tensor((sum(splits), width), dt, nc, gen)
    out = empty((sum(splits), width), dt, False)
    dist.all_to_all_single(out, inp, splits, splits, group=g)
    return [out]


def isend_irecv(g, dt, shape, nc, gen):
    ranks = dist.get_process_group_ranks(g)
    me = group_rank(g)
    nxt, prev = ranks[(me + 1) % SIZE], ranks[(me - 1) % SIZE]
    out = empty(shape, dt, nc)
    works = [dist.irecv(out, src=prev, group=g),
             dist.isend(tensor(shape, dt, nc, gen), dst=nxt, group=g)]
    for w in works:
        w.wait()
    return [out]


def send_recv(g, dt, shape, nc, gen):
    """Blocking ring: rank 0 sends first, the others receive first (from any source)."""
    ranks = dist.get_process_group_ranks(g)
    me = group_rank(g)
    nxt = ranks[(me + 1) % SIZE]
    t, out = tensor(shape, dt, nc, gen), empty(shape, dt, nc)
    if me == 0:
        dist.send(t, dst=nxt, group=g)
        src = dist.recv(out, group=g)
    else:
        src = dist.recv(out, group=g)
        dist.send(t, dst=nxt, group=g)
    return [out, torch.tensor([src], dtype=dt)]


MOVES = {"broadcast": broadcast, "all_gather": all_gather,
         "all_gather_into_tensor": all_gather_into_tensor, "gather": gather,
         "scatter": scatter, "all_to_all": all_to_all,
         "all_to_all_single": all_to_all_single,
         "all_to_all_single_uneven": all_to_all_single_uneven,
         "isend_irecv": isend_irecv, "send_recv": send_recv}
REDUCTIONS = {"all_reduce": all_reduce, "reduce": reduce, "reduce_scatter": reduce_scatter,
              "reduce_scatter_tensor": reduce_scatter_tensor}


def reduce_ops(dtype: torch.dtype):
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex):
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_complex:
        return [R.SUM, R.AVG]  # gloo has no complex PRODUCT, MPI no complex MIN/MAX
    return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]


def tolerance(dtype: torch.dtype, reducing: bool) -> dict:
    """Exact for data movement and integers; float reductions may be ordered differently, and
    16-bit floats are reduced in float32 by mpi4py but in 16 bits by gloo (documented)."""
    if not reducing or not (dtype.is_floating_point or dtype.is_complex):
        return {"rtol": 0, "atol": 0}
    eps = torch.finfo(dtype).eps
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 4 * eps, "atol": 16 * eps}
    return {"rtol": 8 * eps, "atol": 8 * eps}


def run_case(name: str, fn, groups, names, dtype, shape, nc) -> list[str]:
    """Run ``fn`` on gloo and on each of ``names`` (the mpi backends) with the same inputs;
    what disagrees, none if all agree.

    gloo always gets contiguous tensors: it rejects some non-contiguous ones and silently
    reduces the wrong elements of others (all_reduce, broadcast, scatter in torch 2.13).
    """
    seed = zlib.crc32(f"{name}/{dtype}/{shape}/{nc}".encode()) * 8 + RANK
    proxy = GLOO_PROXY.get(dtype, dtype)
    expected = [t.to(dtype) for t in fn(groups["gloo"], proxy, shape, False,
                                         torch.Generator().manual_seed(seed))]
    failures = []
    for backend in names:
        got = fn(groups[backend], dtype, shape, nc, torch.Generator().manual_seed(seed))
        try:
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype,
                                                                   b.shape)
                torch.testing.assert_close(a, b, equal_nan=True,
                                           **tolerance(dtype, name.startswith("reduce")
                                                       or name.startswith("all_reduce")))
        except AssertionError as error:
            failures.append(f"{backend} {name} {dtype} shape={shape} noncontig={nc}: "
                            f"{str(error)[:300]}")
    return failures


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
    cases, failures = 0, []
    for dtype in DTYPES:
        shapes = SHAPES + ([BIG] if dtype == torch.float32 else [])
        for shape, nc in shapes:
            for name, fn in MOVES.items():
                if name == "send_recv" and shape == (0,):
                    continue  # gloo's receive from any source fails on empty tensors
                failures += run_case(name, fn, groups, names, dtype, shape, nc)
                cases += 1
            for name, make in REDUCTIONS.items():
                for op in reduce_ops(dtype):
                    failures += run_case(f"{name}/{op}", make(op), groups, names, dtype, shape,
                                         nc)
                    cases += 1
    for group in groups.values():
        dist.barrier(group=group)
    for backend in names:
        failures += _object_and_functional_collectives(groups[backend], backend)
        failures += _gather_in_place(groups[backend], backend)
    # the Python group's (the compiled one gets the same number from the same call)
    spin = next((g._spin_s for g in groups.values() if hasattr(g, "_spin_s")), None)
    emit(cases=cases, impls=names, failures=failures[:20], failed=len(failures), spin_s=spin)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


def _object_and_functional_collectives(group, backend: str) -> list[str]:
    objects = [None] * SIZE
    dist.all_gather_object(objects, {"rank": RANK}, group=group)
    box = [{"from": 0}] if RANK == 0 else [None]
    dist.broadcast_object_list(box, src=0, group=group)
    failures = []
    if objects != [{"rank": r} for r in range(SIZE)] or box != [{"from": 0}]:
        failures.append(f"{backend} object collectives: {objects} {box}")
    functional = funcol.all_reduce(torch.full((3,), float(RANK)), "sum", group)
    if not torch.equal(functional.wait(), torch.full((3,), float(sum(range(SIZE))))):
        failures.append(f"{backend} functional all_reduce: {functional}")
    return failures


def _gather_in_place(group, backend: str) -> list[str]:
    """FSDP's all-gather: the input is this rank's slice of the output (pytorch#85628)."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.zeros(size * 6, dtype=dtype)
        out[me * 6:(me + 1) * 6] = torch.arange(6) + 100 * me
        dist.all_gather_into_tensor(out, out[me * 6:(me + 1) * 6], group=group)
        expected = torch.cat([torch.arange(6) + 100 * r for r in range(size)]).to(dtype)
        if not torch.equal(out, expected):
            failures.append(f"{backend} all_gather_into_tensor in place {dtype}: {out.tolist()}")
    return failures


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
