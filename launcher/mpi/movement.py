"""The data movement of the mpi4py process group (``launcher.mpi.operations.MPIProcessGroup``):
broadcast, the gathers and scatters, all_to_all and barrier, which run to completion inside the
call, and the truly non-blocking point-to-point ops (send, recv: a ``RequestWork`` to wait on)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.mpi import buffers as mb
from launcher.mpi import waiting


class DataMovement:
    """The group's ops that move data without reducing it."""

    # what the group (``launcher.mpi.operations.MPIProcessGroup``) provides
    _comm: MPI.Intracomm
    _rank_: int
    _size_: int
    _lock: threading.Lock | contextlib.nullcontext
    run: Callable[..., None]

    def broadcast(self, tensors, opts) -> dist.Work | None:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        root = opts.rootRank
        for t in tensors:
            buf = mb.addressable(t)
            if buf.numel():
                self.run("broadcast from root rank", root, self._comm.Ibcast, mb.spec(buf), root)
            if self._rank_ != root:
                mb.write_back(t, buf)
        return waiting.finished(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None) -> dist.Work | None:
        for outputs, t in zip(output_lists, inputs, strict=True):
            buf = mb.addressable(t)
            flat = torch.empty(buf.numel() * self._size_, dtype=buf.dtype)
            if buf.numel():
                self.run("all_gather", None, self._comm.Iallgather, mb.spec(buf),
                          mb.spec(flat, self._size_))
            mb.unflat(flat, outputs)
        return waiting.finished(output_lists, opts)

    def _allgather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        out, buf = mb.addressable(output), mb.addressable(input_)
        if buf.numel():
            # FSDP gathers in place: the input is this rank's block of the output
            in_place = buf.data_ptr() == out.data_ptr() + self._rank_ * buf.nbytes
            self.run("all_gather_into_tensor", None, self._comm.Iallgather,
                      MPI.IN_PLACE if in_place else mb.spec(buf), mb.spec(out, self._size_))
        mb.write_back(output, out)

    def all_gather_single(self, output, input, opts=None) -> dist.Work | None:  # noqa: A002
        self._allgather_into(output, input)
        return waiting.finished([output], opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> dist.Work | None:
        return self.allgather(output_lists, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work | None:
        for output, input_ in zip(outputs, inputs, strict=True):
            self._allgather_into(output, input_)
        return waiting.finished(outputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_lists, inputs, opts) -> dist.Work | None:
        root = opts.rootRank
        at_root = self._rank_ == root
        buf = mb.addressable(inputs[0])
        flat = torch.empty(buf.numel() * self._size_ if at_root else 0, dtype=buf.dtype)
        if buf.numel():
            self.run("gather to root rank", root, self._comm.Igather, mb.spec(buf),
                      mb.spec(flat, self._size_) if at_root else None, root)
        if at_root:
            mb.unflat(flat, output_lists[0])
        return waiting.finished(output_lists, opts)

    def scatter(self, outputs, input_lists, opts) -> dist.Work | None:
        root = opts.rootRank
        out = mb.addressable(outputs[0])
        flat = mb.flat(input_lists[0]) if self._rank_ == root else None
        if out.numel():
            self.run("scatter from root rank", root, self._comm.Iscatter,
                      None if flat is None else mb.spec(flat, self._size_), mb.spec(out), root)
        mb.write_back(outputs[0], out)
        return waiting.finished(outputs, opts)

    def _alltoallv(self, out: torch.Tensor, recv_counts: list[int], inp: torch.Tensor,
                   send_counts: list[int]) -> None:
        send_displs = [0] * self._size_
        recv_displs = [0] * self._size_
        for i in range(1, self._size_):
            send_displs[i] = send_displs[i - 1] + send_counts[i - 1]
            recv_displs[i] = recv_displs[i - 1] + recv_counts[i - 1]
        send, recv = mb.spec(inp), mb.spec(out)
        self.run("all_to_all", None, self._comm.Ialltoallv,
                  [send[0], (send_counts, send_displs), send[2]],
                  [recv[0], (recv_counts, recv_displs), recv[2]])

    def alltoall(self, outputs, inputs, opts=None) -> dist.Work | None:
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
        self._alltoallv(flat_out, [t.numel() for t in outputs], mb.flat(inputs),
                        [t.numel() for t in inputs])
        mb.unflat(flat_out, outputs)
        return waiting.finished(outputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes,  # noqa: A002
                          input_split_sizes, opts=None) -> dist.Work | None:
        out, inp = mb.addressable(output), mb.addressable(input)
        n = self._size_

        def counts(t: torch.Tensor, splits) -> list[int]:
            """Elements per rank: splits count rows (dim 0); none means equal shares."""
            if not splits:
                return [t.numel() // n] * n
            row = t[0].numel() if t.dim() and t.shape[0] else 0
            return [s * row for s in splits]

        self._alltoallv(out, counts(out, output_split_sizes), inp, counts(inp, input_split_sizes))
        mb.write_back(output, out)
        return waiting.finished([output], opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None) -> dist.Work | None:
        self.run("barrier", None, self._comm.Ibarrier)
        return waiting.finished([], opts)

    # -- point to point --------------------------------------------------------------------

    def send(self, tensors, dst: int, tag: int = 0) -> dist.Work:
        buf = mb.addressable(tensors[0])
        with self._lock:
            request = self._comm.Isend(mb.spec(buf), dst, tag)
        return waiting.RequestWork(self, request, "send to rank", dst, buf, None)

    def recv(self, tensors, src: int, tag: int = 0) -> dist.Work:
        return self._irecv(tensors[0], src, tag)

    def recv_anysource(self, tensors, tag: int = 0) -> dist.Work:
        return self._irecv(tensors[0], MPI.ANY_SOURCE, tag)

    def _irecv(self, t: torch.Tensor, src: int, tag: int) -> dist.Work:
        buf = mb.addressable(t)
        with self._lock:
            request = self._comm.Irecv(mb.spec(buf), src, tag)
        if src == MPI.ANY_SOURCE:
            return waiting.RequestWork(self, request, "recv from any rank", None, buf, t)
        return waiting.RequestWork(self, request, "recv from rank", src, buf, t)
