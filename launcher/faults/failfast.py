"""Fail fast: an exception on one rank ends the job on every rank within seconds, cause named.

A rank that raises where its peers do not (a model's forward failing at step 5 on one rank, an
evaluation, a checkpoint write) would leave them waiting in their next collective until the
timeout, and then report a lost peer. So each rank runs a ``Watchdog`` beside its work: a thread
waiting for a ``Notice``. The rank that fails prints its traceback, sends a notice (its rank,
host, exception) to every other rank, waits a moment for them to take it, and ends; each other
rank's watchdog prints one line naming the failure and ends its process, wherever its main
thread is blocked (inside gloo, NCCL or MPI). The failing rank ends first (with ``MPI_Abort``
when MPI runs): launchers that end the whole job when one rank fails (Hydra, Open MPI's mpirun,
torchrun) then report the true cause first, and take down the others. Where nobody does that
(srun without ``--kill-on-bad-exit``, ranks started by hand) they end themselves a moment later.

Notices travel over the rendezvous store when there is one (gloo, nccl: ``StoreChannel``, on a
connection of its own, since a waiting TCPStore client holds up every call on its connection)
or, with the mpi backend, over a duplicate of ``MPI_COMM_WORLD`` (``MpiChannel``, polled).
Exit status: that of the failure, ``EXIT_RANK_FAILED`` for an exception and ``EXIT_USER_ERROR``
for a LaunchError seen by one rank only; on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from launcher.core.errors import EXIT_RANK_FAILED, EXIT_USER_ERROR, LaunchError
from launcher.faults import heartbeat, peer_lost
from launcher.faults.c10d_log import quiet_c10d
from launcher.placement.env import JobEnv

#: how long a failing rank waits for its peers to take its notice before it ends anyway
ACK_WAIT_S = 5.0
#: how long the other ranks leave the failing one to end first, before they end themselves
FOLLOW_S = 2.0
#: how often the MPI channel looks for a notice (each look is one MPI_Iprobe)
MPI_POLL_S = 0.05


@dataclass(frozen=True)
class Notice:
    """What a failing rank tells the others."""

    rank: int
    host: str
    #: the exception's type, or "error" for a LaunchError
    kind: str
    message: str
    hint: str | None = None

    @classmethod
    def of(cls, env: JobEnv, exc: BaseException) -> Notice:
        if isinstance(exc, LaunchError):
            return cls(env.rank, env.hostname, "error", exc.message, exc.hint)
        return cls(env.rank, env.hostname, type(exc).__name__, str(exc).strip())

    @property
    def status(self) -> int:
        return EXIT_USER_ERROR if self.kind == "error" else EXIT_RANK_FAILED

    def text(self) -> str:
        """What every other rank prints: one line, two with the HINT of a user error."""
        if self.kind == "error":
            return str(LaunchError(f"rank {self.rank} on {self.host} failed: {self.message}",
                                   self.hint))
        message = (self.message.splitlines() or [""])[0]
        return (f"error: rank {self.rank} on {self.host} failed with {self.kind}: {message} "
                f"(its traceback is in rank {self.rank}'s output)")

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Notice:
        return cls(**json.loads(data))


class PeerFailed(Exception):
    """Another rank failed (what a survivor reports to torchrun's agent)."""


class StoreChannel:
    """Notices through the rendezvous store: one key per receiving rank, the first one stays."""

    _KEY = "ddp/failfast/notice"
    _ACKS = "ddp/failfast/acks"
    _CLOSED = "ddp/failfast/closed"
    _DONE = b"done"

    def __init__(self, env: JobEnv, store: dist.Store):
        self._env = env
        self._store = store
        self._received = False
        # the watching thread's own connection: a client blocked in wait() holds its connection
        self._watching = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                       timeout=timedelta(seconds=60))

    def publish(self, notice: Notice) -> None:
        for rank in range(self._env.world_size):
            if rank != self._env.rank:
                self._store.compare_set(f"{self._KEY}/{rank}", "", notice.encode())

    def receive(self) -> Notice | None:
        """Block until a notice arrives (None: closed, or the store is gone)."""
        if self._received:
            return None
        self._received = True
        key = f"{self._KEY}/{self._env.rank}"
        try:
            while True:
                try:
                    self._watching.wait([key], timedelta(hours=1))
                    break
                except dist.DistStoreError:  # an hour without news
                    continue
            value = self._watching.get(key)
        except dist.DistError:  # the store's host ended: nothing more can come
            return None
        return None if value == self._DONE else Notice.decode(value)

    def acknowledge(self, notice: Notice) -> None:
        self._watching.add(self._ACKS, 1)

    def acknowledged(self) -> int:
        return self._store.add(self._ACKS, 0)

    def close(self) -> None:
        """Release this rank's watching thread (a notice that came first stays). Rank 0, whose
        process hosts the store, stays until every rank has done so: a store gone under a
        waiting client is an error there, logged with a C++ stack."""
        with quiet_c10d(), contextlib.suppress(dist.DistError):
            self._store.compare_set(f"{self._KEY}/{self._env.rank}", "", self._DONE)
            self._store.add(self._CLOSED, 1)
            if self._env.is_main:
                _wait_until(lambda: self._store.add(self._CLOSED, 0) >= self._env.world_size)


class MpiChannel:
    """Notices as MPI messages on a communicator of their own, looked for every MPI_POLL_S."""

    _NOTICE, _ACK = 1, 2

    def __init__(self, env: JobEnv, world):
        from mpi4py import MPI

        self._mpi = MPI
        self._env = env
        self._comm = world.Dup()  # collective; never matches the training's messages
        self._closed = threading.Event()
        self._pending: list = []
        self._acks = 0

    def publish(self, notice: Notice) -> None:
        self._pending = [self._comm.isend(notice.encode(), dest=rank, tag=self._NOTICE)
                         for rank in range(self._env.world_size) if rank != self._env.rank]

    def receive(self) -> Notice | None:
        while not self._closed.wait(MPI_POLL_S):
            if self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self._NOTICE):
                return Notice.decode(self._comm.recv(source=self._mpi.ANY_SOURCE,
                                                     tag=self._NOTICE))
        return None

    def acknowledge(self, notice: Notice) -> None:
        self._comm.send(b"", dest=notice.rank, tag=self._ACK)

    def acknowledged(self) -> int:
        while self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self._ACK):
            self._comm.recv(source=self._mpi.ANY_SOURCE, tag=self._ACK)
            self._acks += 1
        return self._acks

    def close(self) -> None:
        self._closed.set()


class Watchdog:
    """Ends this rank when another one fails; tells the others when this one does."""

    def __init__(self, env: JobEnv, channel: StoreChannel | MpiChannel | None):
        self._env = env
        self._channel = channel
        self._failing = threading.Event()
        #: the notice of another rank's failure, once one came (the line is printed already)
        self.notice: Notice | None = None
        self._thread = None
        if channel is not None:
            self._thread = threading.Thread(target=self._watch, name="ddp-failfast",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while (notice := self._channel.receive()) is not None:
            if self._failing.is_set():
                self._channel.acknowledge(notice)
                continue  # this rank reports a failure of its own
            self.notice = notice
            for line in notice.text().splitlines():
                print(f"[rank {self._env.rank}] {line}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if self._env.launcher == "torchrun":
                # torchrun names the lowest rank among those that ended in the same second
                # as the root cause: make its summary name the true one there too
                try:
                    raise PeerFailed(notice.text().removeprefix("error: "))
                except PeerFailed as exc:
                    _tell_torchrun(exc)
            self._channel.acknowledge(notice)  # after the line: the failing rank ends next
            if self._env.is_main and isinstance(self._channel, StoreChannel):
                self._wait_for_acks()  # the store lives in this process: let the others read
            time.sleep(FOLLOW_S)
            os._exit(notice.status)

    def fail(self, exc: BaseException) -> int:
        """Report ``exc`` (raised on this rank) here and to every other rank; the exit status."""
        self._failing.set()
        prefix = f"[rank {self._env.rank}] "
        text = str(exc) if isinstance(exc, LaunchError) else "".join(
            traceback.format_exception(exc)).rstrip()
        for line in text.splitlines():
            print(f"{prefix}{line}", file=sys.stderr, flush=True)
        if self._env.launcher == "torchrun":
            _tell_torchrun(exc)
        notice = Notice.of(self._env, exc)
        if self._channel is not None:
            try:
                self._channel.publish(notice)
                self._wait_for_acks()
            except Exception:  # noqa: BLE001 - the channel is gone: the launcher must end the rest
                pass
        return notice.status

    def _wait_for_acks(self) -> None:
        _wait_until(lambda: self._channel.acknowledged() >= self._env.world_size - 1)

    def close(self) -> None:
        """Stop watching (after a run every rank finished)."""
        if self._channel is None:
            return
        heartbeat.stop()
        self._channel.close()
        self._thread.join(timeout=5)


def _wait_until(done, seconds: float = ACK_WAIT_S) -> None:
    """Poll ``done()`` until it is true or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _tell_torchrun(exc: BaseException) -> None:
    """The error file torchrun's agent reads: its summary then shows this failure's message
    and traceback as the root cause, not "To enable traceback see ..."."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    with contextlib.suppress(OSError):  # no error file: the summary only lacks the message
        ErrorHandler().record_exception(exc)  # a no-op unless torchrun set TORCHELASTIC_ERROR_FILE


def start(env: JobEnv, store: dist.Store | None) -> Watchdog:
    """The watchdog for this rank: over ``store`` when there is one, else over MPI."""
    if not env.is_distributed:
        return Watchdog(env, None)
    if store is not None:
        peer_lost.enrol(env, store)  # before any failure: a silent rank cannot say it later
        channel: StoreChannel | MpiChannel = StoreChannel(env, store)
    else:
        from mpi4py import MPI

        channel = MpiChannel(env, MPI.COMM_WORLD)
    # silence is the failure a failing rank cannot announce: the beats name it
    heartbeat.start(env, store, peer_lost.NODE_KEY)
    return Watchdog(env, channel)


def end_process(status: int) -> None:
    """End this process with ``status`` now: ``MPI_Abort`` when MPI runs (the launcher then
    ends every rank), else ``os._exit`` (no teardown that could wait for a failed peer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(status)
    os._exit(status)
