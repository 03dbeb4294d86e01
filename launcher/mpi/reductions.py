"""The reductions of the mpi4py process group (``launcher.mpi.operations.MPIProcessGroup``):
all_reduce, reduce and reduce_scatter in all their forms. Dtypes, AVG and the slicing of large
all_reduces: the semantics in ``launcher.mpi.operations``' docstring."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.mpi import buffers as mb
from launcher.mpi import waiting

_RedOp = dist.ReduceOp.RedOpType

#: all_reduce works through larger buffers in slices of this many bytes, one after another
ALLREDUCE_SLICE_BYTES = 4 << 20


class Reductions:
    """The group's reducing ops; each runs to completion on the group's communicator."""

    # what the group (``launcher.mpi.operations.MPIProcessGroup``) provides
    _comm: MPI.Intracomm
    _rank_: int
    _size_: int
    run: Callable[..., None]

    def _average(self, buf: torch.Tensor) -> None:
        with torch.no_grad():  # buf may be a leaf that requires grad (a DDP parameter)
            buf.div_(self._size_)

    def allreduce(self, tensors, opts=None) -> dist.Work | None:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = _RedOp.SUM if opts is None else opts.reduceOp
        for t in tensors:
            mpi_op, compute, average = mb.reduction(t.dtype, op)
            buf = mb.addressable(t, compute)
            for part in mb.slices(buf, ALLREDUCE_SLICE_BYTES):
                self.run("all_reduce", None, self._comm.Iallreduce, MPI.IN_PLACE, mb.spec(part),
                          mpi_op)
            if average:
                self._average(buf)
            mb.write_back(t, buf)
        return waiting.finished(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work | None:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts) -> dist.Work | None:
        root = opts.rootRank
        at_root = self._rank_ == root
        for t in tensors:
            mpi_op, compute, average = mb.reduction(t.dtype, opts.reduceOp)
            buf = mb.addressable(t, compute)
            if buf.numel():
                self.run("reduce to root rank", root, self._comm.Ireduce,
                          MPI.IN_PLACE if at_root else mb.spec(buf), mb.spec(buf), mpi_op, root)
            if at_root:
                if average:
                    self._average(buf)
                mb.write_back(t, buf)
        return waiting.finished(tensors, opts)

    def _reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, op) -> None:
        """Reduce ``flat`` (``size`` blocks, contiguous, compute dtype) into ``output``."""
        mpi_op, compute, average = mb.reduction(output.dtype, op)
        out = mb.addressable(output, compute)
        if out.numel():
            self.run("reduce_scatter", None, self._comm.Ireduce_scatter_block,
                      mb.spec(flat, self._size_), mb.spec(out), mpi_op)
        if average:
            self._average(out)
        mb.write_back(output, out)

    def reduce_scatter(self, outputs, input_lists, opts) -> dist.Work | None:
        for output, inputs in zip(outputs, input_lists, strict=True):
            _, compute, _ = mb.reduction(output.dtype, opts.reduceOp)
            self._reduce_scatter(output, mb.flat(inputs, compute), opts.reduceOp)
        return waiting.finished(outputs, opts)

    def reduce_scatter_single(self, output, input, opts) -> dist.Work | None:  # noqa: A002
        _, compute, _ = mb.reduction(output.dtype, opts.reduceOp)
        self._reduce_scatter(output, mb.addressable(input, compute), opts.reduceOp)
        return waiting.finished([output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts) -> dist.Work | None:
        for output, input_ in zip(outputs, inputs, strict=True):
            _, compute, _ = mb.reduction(output.dtype, opts.reduceOp)
            self._reduce_scatter(output, mb.addressable(input_, compute), opts.reduceOp)
        return waiting.finished(outputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
