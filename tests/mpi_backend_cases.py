"""Every op and dtype of the mpi backend against gloo on the same inputs: the cases of the
``compare`` scenario of tests/mpi_backend_worker.py, which makes the groups and reports.

gloo is the reference: its results are taken as right, and each implementation of the mpi
backend must give the same tensors (exactly for data movement and integers, within a few ulps
for float reductions, ``tolerance``).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from mpi4py import MPI

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
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


def object_and_functional_collectives(group, backend: str) -> list[str]:
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


def gather_in_place(group, backend: str) -> list[str]:
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


def compare(groups: dict, names: list[str]) -> tuple[int, list[str]]:
    """Every case on ``groups["gloo"]`` and on each of ``names``' groups: how many cases ran,
    and what disagreed."""
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
        failures += object_and_functional_collectives(groups[backend], backend)
        failures += gather_in_place(groups[backend], backend)
    return cases, failures
