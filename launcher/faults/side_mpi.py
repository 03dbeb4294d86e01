"""The side channel over MPI (the mpi backend): see ``launcher.faults.side_channel``.

Beats are empty messages to this rank's watchers (``launcher.faults.watch``), one in flight per
watcher so a stopped one's do not pile up. Everything else is one pickled tuple per message;
a thread of the channel's own looks for both every ``MPI_POLL_S``, passes broadcasts on along
two binomial trees rooted at their origin, answers reads of this rank's posts, and calls the
handlers. Each rank talks to its watchers, the ranks it watches and its O(log N) tree
neighbours: MPI connects lazily, so no rank holds a connection to every other one.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from launcher.faults import watch
from launcher.faults.side_channel import (
    MPI_POLL_S,
    ChannelGone,
    Message,
    Posts,
    SideChannel,
    forwards,
)
from launcher.placement.env import JobEnv

_BEAT, _MESSAGE, _LEFT = 11, 12, 13
#: how long a rank that leaves waits for its watchers to take its last word
LEAVE_S = 1.0
#: the channel's own kinds: a read of a post, and its answer
_READ, _ANSWER = "ddp.read", "ddp.answer"


class MpiSideChannel(SideChannel):
    """The side channel on a duplicate of ``MPI_COMM_WORLD``."""

    def __init__(self, env: JobEnv, world):
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = world.Dup()  # collective; never matches the training's messages
        super().__init__(env, self._comm.allgather(env.node_name))
        self.watch = watch.watch(self.nodes, env.rank)
        self._beats: dict[int, object] = {}
        self._heard: set[int] = set()
        #: the watched ranks that left the job (``leave``): heard from, whatever comes
        self._left: set[int] = set()
        self._heard_lock = threading.Lock()
        self._sends: list = []
        self._sends_lock = threading.Lock()
        self._seen: set[tuple[int, int]] = set()
        self._sequence = 0
        self._posts = Posts()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="ddp-side-channel", daemon=True)
        self._thread.start()

    def exchange(self) -> set[int]:
        """Beat to the watchers; the watched ranks heard since the last call."""
        with self._gone_on_error():
            for peer in self.watch.watchers:
                if peer not in self._beats or self._beats[peer].Test():
                    self._beats[peer] = self._comm.isend(b"", dest=peer, tag=_BEAT)
        with self._heard_lock:
            heard, self._heard = self._heard, set()
            return heard | self._left

    def leave(self, failed: bool = False) -> None:
        """This rank leaves the job: its watchers count it as heard from now on (it ended, it
        is not lost). Best effort, within about LEAVE_S; nothing after a failure: a message
        to a dead peer's endpoint can crash the library (UCX under srun: a segfault), and
        the launcher ends every rank of an MPI job once one fails anyway."""
        if failed:
            return
        try:
            with self._gone_on_error():
                requests = [self._comm.isend(b"", dest=peer, tag=_LEFT)
                            for peer in self.watch.watchers]
                deadline = time.monotonic() + LEAVE_S
                while not self._mpi.Request.Testall(requests) and time.monotonic() < deadline:
                    time.sleep(0.01)
        except ChannelGone:
            pass

    @contextmanager
    def _gone_on_error(self) -> Iterator[None]:
        """mpi4py raises MPI.Exception where the library returns an error (a peer gone)."""
        try:
            yield
        except self._mpi.Exception as exc:
            raise ChannelGone(str(exc)) from exc

    def _isend(self, dest: int, item: tuple) -> None:
        with self._sends_lock, self._gone_on_error():
            self._sends = [request for request in self._sends if not request.Test()]
            self._sends.append(self._comm.isend(pickle.dumps(item), dest=dest, tag=_MESSAGE))

    def send(self, dest: int, kind: str, payload: bytes = b"") -> None:
        self._isend(dest, (self.rank, None, kind, payload))

    def broadcast(self, kind: str, payload: bytes = b"") -> None:
        self._sequence += 1
        item = (self.rank, self._sequence, kind, payload)
        self._seen.add((self.rank, self._sequence))
        for peer in forwards(self.rank, self.rank, self.world_size):
            self._isend(peer, item)

    def post(self, name: str, value: bytes) -> None:
        self._posts.own[name] = value

    def read_many(self, ranks, name, timeout_s=5.0):
        asks = []
        for rank in ranks:
            ask = self._posts.ask()
            asks.append(ask)
            if rank == self.rank:
                self._posts.answer(ask, self._posts.own.get(name))
            else:
                self.send(rank, _READ, pickle.dumps((ask, name)))
        return dict(zip(ranks, self._posts.await_answers(asks, timeout_s), strict=True))

    def _pump(self) -> None:
        status = self._mpi.Status()
        while not self._closed.wait(MPI_POLL_S):
            while self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self._mpi.ANY_TAG,
                                    status=status):
                source, tag = status.Get_source(), status.Get_tag()
                data = self._comm.recv(source=source, tag=tag)
                if tag in (_BEAT, _LEFT):
                    with self._heard_lock:
                        (self._heard if tag == _BEAT else self._left).add(source)
                elif tag == _MESSAGE:
                    self._receive(pickle.loads(data))

    def _receive(self, item: tuple) -> None:
        origin, sequence, kind, payload = item
        if sequence is not None:  # a broadcast: once, passed on first
            if (origin, sequence) in self._seen:
                return
            self._seen.add((origin, sequence))
            for peer in forwards(self.rank, origin, self.world_size):
                if peer != origin:
                    self._isend(peer, item)
        if kind == _READ:
            ask, name = pickle.loads(payload)
            self.send(origin, _ANSWER, pickle.dumps((ask, self._posts.own.get(name))))
        elif kind == _ANSWER:
            self._posts.answer(*pickle.loads(payload))
        else:
            self._deliver(Message(origin, kind, payload))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
