"""Tensors as MPI buffers for the mpi4py backend (``launcher.mpi.backend``): datatypes,
reduction ops, and tensors MPI can read by address (copied only where they must be).

float16/bfloat16 have no MPI type: they move as raw 16-bit words and are reduced in float32.
CUDA tensors go to MPI by device pointer when the library says it is CUDA-aware, else through
host memory.
"""

from __future__ import annotations

import ctypes
import functools
import re

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.core.errors import LaunchError

BACKEND_NAME = "mpi4py"

_RedOp = dist.ReduceOp.RedOpType

#: torch dtype -> MPI datatype for data movement; 16-bit floats move as raw words
_DATATYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T,
    torch.uint64: MPI.UINT64_T,
    torch.bool: MPI.C_BOOL,
}
_HALF = (torch.float16, torch.bfloat16)

_ARITHMETIC = {_RedOp.SUM: MPI.SUM, _RedOp.AVG: MPI.SUM, _RedOp.PRODUCT: MPI.PROD,
               _RedOp.MIN: MPI.MIN, _RedOp.MAX: MPI.MAX}
_BITWISE = {_RedOp.BAND: MPI.BAND, _RedOp.BOR: MPI.BOR, _RedOp.BXOR: MPI.BXOR}
_LOGICAL = {_RedOp.SUM: MPI.LOR, _RedOp.MAX: MPI.LOR, _RedOp.BOR: MPI.LOR,
            _RedOp.PRODUCT: MPI.LAND, _RedOp.MIN: MPI.LAND, _RedOp.BAND: MPI.LAND,
            _RedOp.BXOR: MPI.LXOR}

_CPU = torch.device("cpu")

@functools.cache
def mpi_cuda_support() -> bool | None:
    """What the MPI library says about CUDA buffers; None if it can't say.

    mpi4py 4.1 does not wrap ``MPIX_Query_cuda_support`` (MPICH and Open MPI both export
    it), so it is called in the libmpi mpi4py loaded.
    """
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    with open("/proc/self/maps") as maps:
        paths = set(re.findall(r"/\S*/libmpi[^/\s]*\.so[.\d]*", maps.read()))
    for path in sorted(paths):
        function = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if function is not None:
            function.restype = ctypes.c_int
            return bool(function())
    return None


def cuda_aware() -> bool:
    return bool(mpi_cuda_support())


_reductions: dict = {}


def reduction(dtype: torch.dtype, op) -> tuple[MPI.Op, torch.dtype, bool]:
    """The MPI op for ``op`` on ``dtype``, the dtype to compute in, and whether to average."""
    kind = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType; the enum may come bare
    key = (dtype, kind.value)  # an int: hashing and comparing pybind enums is slow
    try:
        return _reductions[key]
    except KeyError:
        pass
    if dtype == torch.bool:
        table, compute = _LOGICAL, dtype
    elif dtype.is_floating_point or dtype.is_complex:
        table, compute = _ARITHMETIC, torch.float32 if dtype in _HALF else dtype
        if dtype.is_complex and kind in (_RedOp.MIN, _RedOp.MAX):
            table = {}
    else:
        table, compute = {**_ARITHMETIC, **_BITWISE}, dtype
        table.pop(_RedOp.AVG)
    if kind not in table:
        raise LaunchError(
            f"the {BACKEND_NAME} backend cannot reduce {dtype} tensors with ReduceOp.{kind.name}",
            "use SUM/PRODUCT/MIN/MAX, AVG only for floating dtypes, BAND/BOR/BXOR only for "
            "integer and bool dtypes, no MIN/MAX for complex; cast the tensor if needed",
        )
    result = _reductions[key] = (table[kind], compute, kind == _RedOp.AVG)
    return result


def addressable(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a contiguous tensor MPI can read by address: ``t`` itself when it already is."""
    if t.is_cpu and (dtype is None or dtype == t.dtype) and t.is_contiguous():
        return t
    if t.is_cuda and cuda_aware():
        out = t.detach().to(dtype=dtype).contiguous()
        torch.cuda.current_stream(t.device).synchronize()
        return out
    # .to() keeps a non-contiguous layout; .contiguous() is what makes one dense copy
    return t.detach().to(device=_CPU, dtype=dtype).contiguous()


def spec(t: torch.Tensor, blocks: int = 1) -> list:
    """An mpi4py buffer spec over the memory of contiguous ``t``, without a copy.

    MPI counts gather/scatter buffers per rank: ``blocks`` splits ``t`` into that many.
    """
    n = t.numel()
    return [MPI.buffer.fromaddress(t.data_ptr(), n * t.element_size()), n // blocks,
            _DATATYPES[t.dtype]]


def slices(t: torch.Tensor, max_bytes: int) -> list[torch.Tensor]:
    """Contiguous ``t`` as consecutive flat views of at most ``max_bytes``; none when empty."""
    if t.numel() * t.element_size() <= max_bytes:
        return [t] if t.numel() else []  # the common case, without the cost of views
    flat = t.view(-1)
    step = max(1, max_bytes // t.element_size())
    return [flat[i:i + step] for i in range(0, flat.numel(), step)]


def write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:
        dst.detach().copy_(src)


def flat(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One contiguous CPU tensor holding ``tensors`` back to back (a copy)."""
    dtype = dtype or tensors[0].dtype
    return torch.cat([t.detach().reshape(-1).to(device=_CPU, dtype=dtype) for t in tensors])


def unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[offset:offset + n].view(t.shape))
        offset += n
