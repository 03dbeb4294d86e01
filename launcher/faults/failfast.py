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

Notices travel on the side channel (``launcher.faults.side_channel``) as one broadcast; each rank
that takes one acknowledges it to the failing rank, unless it is failing itself: when every rank
fails at once (the commonest bug) each has printed its own traceback, nobody acknowledges
(N - 1 acks a rank, to as many ranks, would open N^2 connections), and a failing rank stops
waiting for acks once another rank's notice has come.
Exit status: that of the failure, ``EXIT_RANK_FAILED`` for an exception and ``EXIT_USER_ERROR``
for a LaunchError seen by one rank only; on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass

import torch.distributed as dist

from launcher.core.errors import EXIT_RANK_FAILED, EXIT_USER_ERROR, LaunchError
from launcher.faults.heartbeat import Heartbeat
from launcher.faults.side_channel import ChannelGone, SideChannel
from launcher.faults.side_socket import SocketSideChannel
from launcher.placement.env import JobEnv

#: how long a failing rank waits for its peers to take its notice before it ends anyway
ACK_WAIT_S = 5.0
#: how long the other ranks leave the failing one to end first, before they end themselves
FOLLOW_S = 2.0
#: the side channel's kinds: a failure, and "I took it"
NOTICE_KIND, ACK_KIND = "ddp.notice", "ddp.ack"


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


class Watchdog:
    """Ends this rank when another one fails; tells the others when this one does. Owns the
    side channel it watches and the heartbeat beating on it (None, None: not distributed)."""

    def __init__(self, env: JobEnv, channel: SideChannel | None,
                 beat: Heartbeat | None = None):
        self._env = env
        #: the side channel (``launcher.faults.side_channel``), for the hang watch
        self.channel = channel
        #: this rank's heartbeat (``launcher.faults.heartbeat``), for who names silent ranks
        self.heartbeat = beat
        self._failing = threading.Event()
        #: the notice of another rank's failure, once one came (the line is printed already)
        self.notice: Notice | None = None
        self._notices: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()
        self._acks = 0
        #: set when another rank's notice came: it fails too, and acknowledges nothing
        self._peer_failed = threading.Event()
        self._thread = None
        if channel is not None:
            channel.on(NOTICE_KIND, self._take_notice)
            channel.on(ACK_KIND, self._count_ack)
            self._thread = threading.Thread(target=self._watch, name="ddp-failfast",
                                            daemon=True)
            self._thread.start()

    def _take_notice(self, message) -> None:
        self._peer_failed.set()
        self._notices.put(Notice.decode(message.payload))

    def _count_ack(self, _message) -> None:
        self._acks += 1

    def _acknowledge(self, notice: Notice) -> None:
        with contextlib.suppress(ChannelGone):  # it ended already: nobody waits for this
            self.channel.send(notice.rank, ACK_KIND)

    def _watch(self) -> None:
        while (notice := self._notices.get()) is not None:
            if self._failing.is_set():
                continue  # failing too: its own traceback tells, and the peer waits no more
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
            self._acknowledge(notice)  # after the line: the failing rank ends next
            self.channel.linger(FOLLOW_S)  # the notice passed on to children connected late
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
        if self.channel is not None:
            try:
                given_up_at = time.monotonic() + ACK_WAIT_S
                self.channel.broadcast(NOTICE_KIND, notice.encode())
                # a rank that fails too acknowledges nothing: its own traceback says enough
                _wait_until(lambda: self._acks >= self._env.world_size - 1
                            or self._peer_failed.is_set())
                if self._acks < self._env.world_size - 1:  # children connected to late?
                    self.channel.drain(max(0.0, given_up_at - time.monotonic()))
            except ChannelGone:  # the launcher must end the rest
                pass
        return notice.status

    def close(self) -> None:
        """Stop watching (after a run every rank finished)."""
        if self.channel is None:
            return
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.channel.close()
        self._notices.put(None)
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
    """The watchdog for this rank: over TCP between the ranks when there is a rendezvous
    ``store``, else over MPI."""
    if not env.is_distributed:
        return Watchdog(env, None)
    channel = _open_channel(env, store)
    # silence is the failure a failing rank cannot announce: the beats name it
    return Watchdog(env, channel, Heartbeat(env, channel))


def _open_channel(env: JobEnv, store: dist.Store | None) -> SideChannel:
    """Collective: the side channel over TCP when there is a rendezvous store (gloo, nccl),
    else over MPI."""
    if store is not None:
        return SocketSideChannel(env, store)
    from mpi4py import MPI

    from launcher.faults.side_mpi import MpiSideChannel

    return MpiSideChannel(env, MPI.COMM_WORLD)
