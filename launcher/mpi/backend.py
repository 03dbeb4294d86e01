"""A torch.distributed backend on mpi4py, for PyPI wheels of PyTorch built without MPI.

Stock wheels answer ``init_process_group("mpi")`` with "Distributed package doesn't have MPI
built in". This module registers a Python process group named ``mpi4py`` that runs every
collective DDP and users call over MPI through mpi4py:

    from launcher.mpi import backend as mpi_backend
    from mpi4py import MPI
    name = mpi_backend.register()          # idempotent, returns BACKEND_NAME
    dist.init_process_group(name, store=dist.HashStore(),
                            rank=MPI.COMM_WORLD.rank, world_size=MPI.COMM_WORLD.size,
                            timeout=datetime.timedelta(minutes=10))

The store is not used (any store will do; ``HashStore`` needs no network; use ``env://``
instead when gloo groups are to be made beside it with ``new_group``). The world is
``MPI.COMM_WORLD``: rank and world size must equal MPI's, otherwise every rank raises
``LaunchError``. Each process group gets its own communicator, so groups never match each
other's messages: the world group a ``Dup`` of COMM_WORLD, ``dist.new_group(ranks)`` a
``Create_group`` over those ranks (ranks of the default group, which must be MPI's ranks; the
default group may be another backend, e.g. gloo, launched with MPI's rank and size).

Every new communicator first all-reduces a known 4 MiB pattern and, if any rank got wrong
data, raises LaunchError on every rank: MPICH's non-blocking collectives return wrong sums
when its single-copy transfers (CMA) are blocked, as under Docker's default seccomp profile.

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

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.core.errors import LaunchError, PeerLost
from launcher.faults import heartbeat
from launcher.mpi import buffers as mb
from launcher.mpi import segments as mpi_segments
from launcher.mpi import waiting

BACKEND_NAME = mb.BACKEND_NAME

_RedOp = dist.ReduceOp.RedOpType

#: int32 words of the all_reduce each new communicator checks itself with: 4 MiB, above
#: MPICH's threshold for single-copy (CMA) transfers even when split among many ranks
_PROBE_WORDS = 1 << 20

#: all_reduce works through larger buffers in slices of this many bytes, one after another
ALLREDUCE_SLICE_BYTES = 4 << 20

def register() -> str:
    """Register the backend with torch for cpu and cuda tensors; safe to call again."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    return BACKEND_NAME


class MPIProcessGroup(dist.ProcessGroup):
    """A process group whose ops run on one MPI communicator (see the module docstring)."""

    def __init__(self, comm: MPI.Intracomm, timeout: timedelta):
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._rank_ = comm.rank
        self._size_ = comm.size
        self._timeout_s = timeout.total_seconds()
        multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._lock = contextlib.nullcontext() if multiple else threading.Lock()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def size(self) -> int:
        return self._size_

    def rank(self) -> int:
        return self._rank_

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
                     self._rank_)

    def _run(self, op: str, peer: int | None, start, *args) -> None:
        with self._lock:
            request = start(*args)
        self._wait(request, op, peer)

    # -- reductions ------------------------------------------------------------------------

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
                self._run("all_reduce", None, self._comm.Iallreduce, MPI.IN_PLACE, mb.spec(part),
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
                self._run("reduce to root rank", root, self._comm.Ireduce,
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
            self._run("reduce_scatter", None, self._comm.Ireduce_scatter_block,
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

    # -- data movement ---------------------------------------------------------------------

    def broadcast(self, tensors, opts) -> dist.Work | None:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        root = opts.rootRank
        for t in tensors:
            buf = mb.addressable(t)
            if buf.numel():
                self._run("broadcast from root rank", root, self._comm.Ibcast, mb.spec(buf), root)
            if self._rank_ != root:
                mb.write_back(t, buf)
        return waiting.finished(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None) -> dist.Work | None:
        for outputs, t in zip(output_lists, inputs, strict=True):
            buf = mb.addressable(t)
            flat = torch.empty(buf.numel() * self._size_, dtype=buf.dtype)
            if buf.numel():
                self._run("all_gather", None, self._comm.Iallgather, mb.spec(buf),
                          mb.spec(flat, self._size_))
            mb.unflat(flat, outputs)
        return waiting.finished(output_lists, opts)

    def _allgather_into(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        out, buf = mb.addressable(output), mb.addressable(input_)
        if buf.numel():
            # FSDP gathers in place: the input is this rank's block of the output
            in_place = buf.data_ptr() == out.data_ptr() + self._rank_ * buf.nbytes
            self._run("all_gather_into_tensor", None, self._comm.Iallgather,
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
            self._run("gather to root rank", root, self._comm.Igather, mb.spec(buf),
                      mb.spec(flat, self._size_) if at_root else None, root)
        if at_root:
            mb.unflat(flat, output_lists[0])
        return waiting.finished(output_lists, opts)

    def scatter(self, outputs, input_lists, opts) -> dist.Work | None:
        root = opts.rootRank
        out = mb.addressable(outputs[0])
        flat = mb.flat(input_lists[0]) if self._rank_ == root else None
        if out.numel():
            self._run("scatter from root rank", root, self._comm.Iscatter,
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
        self._run("all_to_all", None, self._comm.Ialltoallv,
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
        self._run("barrier", None, self._comm.Ibarrier)
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


def _check_world(rank: int, size: int, source: str) -> str | None:
    world = MPI.COMM_WORLD
    if (rank, size) == (world.rank, world.size):
        return None
    return (f"{source} has rank {rank} of {size}, but MPI started this process as rank "
            f"{world.rank} of {world.size}")


_HINT = ("start every rank through MPI: mpiexec -n N, or under Slurm srun --mpi=pmi2 or "
         "--mpi=pmix (with --mpi=none each task is an MPI world of its own); when calling "
         "init_process_group "
         "yourself, pass rank=MPI.COMM_WORLD.rank and world_size=MPI.COMM_WORLD.size")


def _create(opts, backend_options=None) -> MPIProcessGroup:
    """torch's factory hook (``extended_api=True``): one communicator per process group."""
    return MPIProcessGroup(communicator(opts), opts.timeout)


def communicator(opts) -> MPI.Intracomm:
    """The checked communicator of a new group (``opts``: torch's backend options), also for
    the compiled backend (``launcher.mpi.cxx``)."""
    ranks = list(opts.global_ranks_in_group)
    timeout = opts.timeout
    world = MPI.COMM_WORLD
    if not dist.is_initialized():
        # the default group: every MPI rank is here, so all agree on failure and fail together
        problem = _check_world(opts.group_rank, opts.group_size, "init_process_group")
        failed = [r for r, bad in enumerate(world.allgather(problem is not None)) if bad]
        if failed:
            raise LaunchError(problem or f"MPI rank(s) {', '.join(map(str, failed))} were given "
                              "a rank or world size that does not match MPI's", _HINT)
        # every rank is here: a user's script that started MPI itself, as well as
        # process_group, leaves no named segment behind if the job ends in MPI_Abort
        mpi_segments.unlink_mapped(world)
        return _checked(world.Dup(), timeout)
    problem = _check_world(dist.get_rank(), dist.get_world_size(), "the default process group")
    if problem:
        raise LaunchError(f"cannot create a {BACKEND_NAME} group: {problem}", _HINT)
    if ranks == list(range(world.size)):
        comm = world.Dup()
    else:
        world_group = world.Get_group()
        members = world_group.Incl(ranks)
        comm = world.Create_group(members)  # collective over the members only
        members.Free()
        world_group.Free()
    return _checked(comm, timeout)


def _checked(comm: MPI.Intracomm, timeout: timedelta) -> MPI.Intracomm:
    check_transport(comm, timeout.total_seconds())
    return comm


def overdue(what: str, elapsed: float, timeout_s: float, rank: int) -> None:
    """A wait past its timeout: ``launcher.heartbeat.overdue``, and ``MPI_Abort`` at exit
    after a lost peer (the MPI operation cannot be cancelled)."""
    try:
        heartbeat.overdue(what, elapsed, timeout_s, rank)
    except PeerLost:
        waiting.abort_at_exit()
        raise


def check_transport(comm: MPI.Intracomm, timeout_s: float) -> None:
    """All-reduce a known pattern and fail on every rank if any got wrong data.

    MPICH copies large intra-node messages with process_vm_readv (CMA). Where that call
    is refused (Docker's default seccomp profile, ranks in separate user namespaces),
    MPICH 5.0.2's non-blocking collectives (which this backend uses) complete with wrong
    data instead of an error. launcher/mpi/cma.py turns CMA off there before MPI starts;
    this check catches what it could not decide: the user's own setting, a host MPI.
    """
    probe = torch.full((_PROBE_WORDS,), comm.rank + 1, dtype=torch.int32)
    request = comm.Iallreduce(MPI.IN_PLACE, mb.spec(probe), MPI.SUM)
    waiting.wait(request, contextlib.nullcontext(), None, timeout_s,
                 "transport check all_reduce", None, comm.size, comm.rank)
    good = bool((probe == comm.size * (comm.size + 1) // 2).all())
    bad = [r for r, ok in enumerate(comm.allgather(good)) if not ok]
    if bad:
        raise LaunchError(
            f"MPI delivered wrong data in a 4 MiB test all_reduce (wrong on rank(s) "
            f"{', '.join(map(str, bad))} of this group)",
            "MPI's single-copy transfers (CMA, process_vm_readv) are blocked between "
            "this node's ranks, but were forced on (the launcher turns them off by itself "
            "when it finds them blocked): unset MPIR_CVAR_CH4_CMA_ENABLE and OMPI_MCA_smsc "
            "or set MPIR_CVAR_CH4_CMA_ENABLE=0, or run a node's ranks in one namespace "
            "(ch-run --join, apptainer --sharens) where ptrace is allowed",
        )
