"""How the mpi4py backend (``launcher.mpi.backend``) waits: every op is started non-blocking
and polled; past the group's timeout the heartbeats (``launcher.faults.heartbeat``) decide whether a
peer is lost (``PeerLost``, and ``MPI_Abort`` at exit, since the op cannot be cancelled and
would hang ``MPI_Finalize``) or alive and busy (the wait goes on). Plus the Work objects ops
return: a finished one, or a pending point-to-point request.
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future

from launcher.core.errors import PeerLost
from launcher.faults import exits, heartbeat
from launcher.mpi import buffers as mb


class _Polling(Protocol):
    """What a pending Work needs of its group (``launcher.mpi.operations.MPIProcessGroup``),
    named here so that this module does not import the backend it serves."""

    _lock: object

    def _wait(self, request: MPI.Request, op: str, peer: int | None,
              status: MPI.Status | None = None) -> None: ...

#: polls of a request (about 1 us each from Python) before each further poll gives up the
#: CPU: MPICH spins for about as long (1000 polls of its own) before it yields
POLLS_BEFORE_YIELD = 50
#: a wait longer than this sleeps between polls (doubling up to MAX_PAUSE_S), not to burn a
#: core that another rank, the heartbeat or a data loader needs. The compiled backend waits
#: alike: it shares kPollsBeforeYield and kMaxPause (cxx_work.h; tests/test_mpi_cxx.py keeps
#: them equal) and is given its group's spin (``spin_s``).
#: Not shorter: MPI moves data only while polled, so a rank asleep when its late peer arrives
#: slows the exchange (1 ms: an 80 KiB all_reduce after skewed compute 277 us, not 55 us)
SPIN_S = 0.010
MAX_PAUSE_S = 200e-6


def spin_s(comm: MPI.Intracomm) -> float:
    """How long a wait of ``comm``'s ops may spin: SPIN_S, or none where the ranks of ``comm``
    on this node outnumber the CPUs they may run on (the union of their affinity masks). There
    a spinning rank holds the core that the peer it waits for needs, as Open MPI's
    yield-when-idle for an oversubscribed node avoids; 4 ranks on 2 cores spent a quarter less
    CPU on the same ops. Collective over ``comm``: one node-local split and one reduction.
    Ranks of the node outside ``comm`` are not counted, so a subgroup may still spin."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = sum(1 << cpu for cpu in os.sched_getaffinity(0))
        cpus = node.allreduce(mine, op=MPI.BOR).bit_count()
        crowded = cpus < node.size
    finally:
        node.Free()
    return 0.0 if crowded else SPIN_S


def wait(request: MPI.Request, lock, status: MPI.Status | None, timeout_s: float, op: str,
         peer: int | None, size: int, rank: int, spin: float = SPIN_S) -> None:
    """Poll ``request`` until done; past ``timeout_s`` as ``heartbeat.overdue`` allows.
    ``op`` and ``peer`` (a root or partner rank) name the op in the error; ``spin``: how long
    to yield between polls before sleeping (``spin_s``)."""
    with lock:
        if request.Test(status):
            return
    start = time.monotonic()
    deadline = start + timeout_s
    polls = 0
    pause = 1e-6
    while True:
        with lock:
            if request.Test(status):
                return
        polls += 1
        now = time.monotonic()
        if polls <= POLLS_BEFORE_YIELD:
            pass
        elif now - start < spin:
            # like MPICH's own wait loop: when ranks outnumber free cores, a peer waiting
            # for a CPU would otherwise wait out this process's whole time slice
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
        if now > deadline:
            what = op if peer is None else f"{op} {peer}"
            try:
                heartbeat.overdue(f"{what} on a group of {size} ranks",
                                  now - deadline + timeout_s, timeout_s, rank)
            except PeerLost:
                abort_at_exit()
                raise


def finished(result, opts) -> dist.Work | None:
    """A completed Work, or none when the caller asked for a synchronous op: torch's Python
    API then skips ``wait`` (its path for backends that sync inside the call), which saves
    building a future per op."""
    if opts is not None and not opts.asyncOp:
        return None
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class RequestWork(dist._Work):
    """A pending point-to-point request; ``wait`` polls it against the group's timeout."""

    def __init__(self, pg: _Polling, request: MPI.Request, op: str, peer: int | None,
                 buf: torch.Tensor, tensor: torch.Tensor | None):
        super().__init__()
        self._pg, self._request, self._op, self._peer = pg, request, op, peer
        # buf must outlive the request; tensor (a receive's target) gets buf's data at the end
        self._buf, self._tensor = buf, tensor
        self._status = MPI.Status()
        self._finished = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._finished:
            self._pg._wait(self._request, self._op, self._peer, self._status)
            self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._finished:
            with self._pg._lock:
                done = self._request.Test(self._status)
            if done:
                # not wait(): testing the spent request again would blank the status (source)
                self._finish()
        return self._finished

    def _finish(self) -> None:
        if self._tensor is not None:
            mb.write_back(self._tensor, self._buf)
        self._finished = True

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut = torch.futures.Future()
        fut.set_result([self._tensor if self._tensor is not None else self._buf])
        return fut

    def _source_rank(self) -> int:
        self.wait()
        return self._status.Get_source()

    def source_rank(self) -> int:
        return self._source_rank()


def abort_at_exit() -> None:
    """A timed-out MPI op can't be cancelled and would hang MPI_Finalize: abort instead."""
    atexit.unregister(_abort)  # once, however many ops time out: atexit holds the one record
    atexit.register(_abort)


def _abort() -> None:
    exits.abort_mpi(MPI, 1)
