"""The operations of the mpi4py process group (``MPIProcessGroup``): every collective and
point-to-point op torch.distributed calls, over one MPI communicator: the group and its waits
here, the ops in ``launcher.mpi.reductions`` and ``launcher.mpi.movement``. How a group is made
and registered: ``launcher.mpi.backend``.

Semantics and strategies:

* Collectives run to completion inside the call (``async_op=True`` returns a finished Work;
  a synchronous call returns none, which torch's Python API accepts), so DDP gets no overlap
  of communication with backward. send/recv/isend/irecv are truly non-blocking
  (``Isend``/``Irecv``; ``Work.wait`` waits on the request).
* Also covered: object collectives (all_gather_object, broadcast_object_list, ...),
  batch_isend_irecv, the *_coalesced variants, functional collectives
  (``torch.distributed._functional_collectives``). Not: monitored_barrier (torch allows it on
  gloo only), PREMUL_SUM.
* List forms (all_gather, gather, scatter, all_to_all, reduce_scatter) go through one flat
  buffer, a copy; the tensor forms (all_gather_into_tensor, reduce_scatter_tensor,
  all_to_all_single with even or uneven splits) and all_reduce/broadcast/reduce don't.
* Timeouts: every op, collective and point-to-point, is started non-blocking and polled against
  the group's timeout (a per-call ``timeout`` in an op's options is not consulted;
  ``launcher.mpi.waiting``). Past it, the heartbeats decide (``launcher.faults.heartbeat``): a
  silent peer makes it ``PeerLost`` naming the op and the silent ranks and nodes, a peer that still
  beats (busy writing a checkpoint) lets the wait go on, up to 10 times the timeout. Without
  heartbeats (a group made without ``launcher.group.process_group``) the timeout ends the wait. The
  MPI operation cannot be cancelled, so the process then calls ``MPI_Abort`` at exit rather
  than hang in ``MPI_Finalize``. Inside DDP's backward the same error comes out of
  ``loss.backward()``.
* Dtypes: float32/64, int8/16/32/64, uint8/16/32/64, bool, complex64/128 map to MPI types.
  float16/bfloat16 have no MPI type: data movement sends raw 16-bit words; reductions are
  computed in float32 and rounded back once, so results can differ from gloo (which rounds
  after every addition) in the last bit.
* bool reductions are logical (SUM/MAX/BOR -> or, PRODUCT/MIN/BAND -> and, BXOR -> xor).
  AVG is SUM divided by the group size, for floating and complex dtypes only.
* Memory: contiguous CPU tensors are handed to MPI by address, without copies; non-contiguous
  tensors are copied to contiguous ones and back. CUDA tensors go to MPI by device pointer when
  the MPI library says it is CUDA-aware (``MPIX_Query_cuda_support``), else they are staged
  through host memory (a copy each way); the staged path is tested on a GPU machine (pip
  MPICH is not CUDA-aware), the by-pointer path is not.
* all_reduce of more than 4 MiB runs as consecutive all_reduces of 4 MiB slices: MPICH's
  shared-memory all_reduce took 2-3x as long for 16-256 MiB in one piece as in slices that stay
  in cache between its copy and reduce passes (benchmarks/README.md). Each element is still
  reduced once by the same op, so results are those of the one-piece call.
* Threads: DDP calls collectives from autograd threads. Unless MPI provides
  ``MPI_THREAD_MULTIPLE``, every MPI call is serialised with a lock.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch.distributed as dist
from mpi4py import MPI

from launcher.mpi import buffers as mb
from launcher.mpi import waiting
from launcher.mpi.movement import DataMovement
from launcher.mpi.reductions import Reductions

BACKEND_NAME = mb.BACKEND_NAME


class MPIProcessGroup(Reductions, DataMovement, dist.ProcessGroup):
    """A process group whose ops run on one MPI communicator (see the module docstring): its
    communicator, name and waits here, the reductions (``launcher.mpi.reductions``) and the
    data movement and point-to-point ops (``launcher.mpi.movement``) from its two bases."""

    def __init__(self, comm: MPI.Intracomm, timeout: timedelta, spin_s: float):
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._rank_ = comm.rank
        self._size_ = comm.size
        self._timeout_s = timeout.total_seconds()
        self._spin_s = spin_s
        multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._lock = contextlib.nullcontext() if multiple else threading.Lock()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def size(self) -> int:
        return self._size_

    def rank(self) -> int:
        return self._rank_

    @property
    def comm(self) -> MPI.Intracomm:
        return self._comm

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self._rank_}, size={self._size_})"

    def _set_group_name(self, name: str) -> None:
        # torch keeps the name on a group's C++ backends; this group has none, so it keeps the
        # name itself (functional collectives, as DTensor uses them, look groups up by name)
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def shutdown(self) -> None:
        """Free the communicator (destroy_process_group calls this on every rank)."""
        if self._comm != MPI.COMM_NULL:
            self._comm.Free()

    # -- waiting ---------------------------------------------------------------------------

    def _wait(self, request: MPI.Request, op: str, peer: int | None = None,
              status: MPI.Status | None = None) -> None:
        """Poll ``request`` until done (``launcher.mpi.waiting.wait``); ``op`` and ``peer`` (a
        root or point-to-point partner) name the op in the error."""
        waiting.wait(request, self._lock, status, self._timeout_s, op, peer, self._size_,
                     self._rank_, self._spin_s)

    def run(self, op: str, peer: int | None, start, *args) -> None:
        """Start an op on the communicator (``start(*args)``: an ``I...`` call) and wait for it."""
        with self._lock:
            request = start(*args)
        self._wait(request, op, peer)
