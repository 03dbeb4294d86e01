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

The ops themselves and their semantics: ``launcher.mpi.operations``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from launcher.core.errors import LaunchError, PeerLost
from launcher.faults import heartbeat
from launcher.mpi import buffers as mb
from launcher.mpi import segments as mpi_segments
from launcher.mpi import waiting
from launcher.mpi.operations import BACKEND_NAME, MPIProcessGroup

#: int32 words of the all_reduce each new communicator checks itself with: 4 MiB, above
#: MPICH's threshold for single-copy (CMA) transfers even when split among many ranks
_PROBE_WORDS = 1 << 20

__all__ = ["BACKEND_NAME", "MPIProcessGroup", "register"]


def register() -> str:
    """Register the backend with torch for cpu and cuda tensors; safe to call again."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    return BACKEND_NAME


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
    comm = communicator(opts)
    return MPIProcessGroup(comm, opts.timeout, waiting.spin_s(comm))


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
    """A wait past its timeout: ``launcher.faults.heartbeat.overdue``, and ``MPI_Abort`` at
    exit after a lost peer (the MPI operation cannot be cancelled)."""
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
