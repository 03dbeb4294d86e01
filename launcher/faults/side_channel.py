"""The side channel: what the ranks tell each other outside the training's collectives.

One per process, opened with the process group by ``launcher.faults.failfast.start``, held by
its ``Watchdog`` and handed from there to who needs it (the heartbeat, the hang watch). It
carries the heartbeats (``exchange``: a beat to this rank's watchers,
``launcher.faults.watch``), the fail-fast notices and silence reports (``broadcast``), and small
messages and posts of any module (``send``, ``on``, ``post``, ``read``). Two transports with
the same methods:

- ``SocketSideChannel`` (gloo, nccl; ``launcher.faults.side_socket``): TCP connections from
  rank to rank, each rank listening on a port of its own. The rendezvous store serves the start
  only (the ranks' addresses and nodes), so nothing per second goes through rank 0.
- ``MpiSideChannel`` (the mpi backend; ``launcher.faults.side_mpi``): MPI messages on a ``Dup``
  of ``MPI_COMM_WORLD``, looked for every ``MPI_POLL_S`` by a thread of its own.

Both send from rank to rank (``SideChannel`` here): a beat goes to this rank's two
watchers only, a broadcast travels along two binomial trees rooted at its origin (O(log N)
hops; a rank that stopped inside one tree leaves the other one to carry it), and a post is
read by asking its rank.

Handlers (``on``) run on a thread of the channel's own: they must return quickly. A call that
cannot reach the others raises ``ChannelGone``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launcher.faults import watch
from launcher.placement.env import JobEnv

#: how often the MPI transport looks for messages (each look is one MPI_Iprobe)
MPI_POLL_S = 0.05
#: what a ``read`` of another rank's post waits for by default
READ_S = 5.0
#: the channel's own kinds: a read of a post ("ASK NAME"), and its answer ("ASK -" for none,
#: "ASK +VALUE"): no pickles, since anyone who reaches a TCP transport's port can send one
_READ, _ANSWER = "ddp.read", "ddp.answer"


@dataclass(frozen=True)
class Message:
    """What one rank told another."""

    source: int
    #: what it is about; kinds that start with "ddp." are the launcher's own
    kind: str
    payload: bytes


Handler = Callable[[Message], None]


class ChannelGone(Exception):
    """A call on the side channel failed: the rank it was for ended or cannot be reached, or
    the MPI library reports a peer gone. Both transports raise only this, so that their callers
    read it as "the others are out of reach" and a bug in a handler is never taken for it."""


def tree_children(position: int, size: int) -> list[int]:
    """A binomial tree's children of ``position`` (0 is the root): reached in log2(size) hops."""
    children = []
    step = 1
    while step <= position:
        step *= 2
    while position + step < size:
        children.append(position + step)
        step *= 2
    return children


def forwards(rank: int, origin: int, size: int) -> list[int]:
    """Where ``rank`` passes on a broadcast from ``origin``: its children in two binomial trees
    rooted at the origin, one counting up from it and one counting down."""
    up = [(origin + child) % size for child in tree_children((rank - origin) % size, size)]
    down = [(origin - child) % size for child in tree_children((origin - rank) % size, size)]
    return list(dict.fromkeys(up + down))


class Posts:
    """A rank's own posts, and the answers to its reads that are on their way."""

    def __init__(self):
        self.own: dict[str, bytes] = {}
        self._answers: dict[int, bytes | None] = {}
        self._arrived = threading.Condition()
        self._next = 0

    def ask(self) -> int:
        with self._arrived:
            self._next += 1
            return self._next

    def answer(self, ask: int, value: bytes | None) -> None:
        with self._arrived:
            self._answers[ask] = value
            self._arrived.notify_all()

    def await_answers(self, asks: Sequence[int], timeout_s: float) -> list[bytes | None]:
        """The answers to ``asks``; None for each one not in within ``timeout_s``."""
        with self._arrived:
            self._arrived.wait_for(lambda: all(ask in self._answers for ask in asks), timeout_s)
            return [self._answers.pop(ask, None) for ask in asks]


def neighbours(rank: int, size: int) -> list[int]:
    """Every rank that ``rank`` may pass a broadcast on to, whatever its origin: a binomial
    tree's children lie 2**k positions away, up or down."""
    found, step = {}, 1
    while step < size:
        found.update(dict.fromkeys(((rank + step) % size, (rank - step) % size)))
        step *= 2
    found.pop(rank, None)
    return list(found)


class SideChannel:
    """Beats, messages, broadcasts and posts from rank to rank, no rank in the middle. A
    transport moves the bytes (``_beat``: to one watcher; ``_send_item``: one message to one
    rank) and calls ``_heard`` and ``_receive`` for what arrives, on a thread of its own."""

    #: whether a rank that failed may still send (its last word): not over MPI, where a
    #: message to a dead peer's endpoint can crash the library (``MpiSideChannel.leave``)
    sends_after_failure = True

    def __init__(self, env: JobEnv, nodes: Sequence[str]):
        self.rank = env.rank
        self.world_size = env.world_size
        #: every rank's node (``JobEnv.node_name``), in rank order
        self.nodes = list(nodes)
        self._handlers: dict[str, Handler] = {}
        self.watch = watch.watch(self.nodes, env.rank)
        #: when each watched rank was last heard (time.monotonic), stamped on arrival by the
        #: transport's thread: no other thread's delay (a beat that waits to go out) can make a
        #: rank that beats look silent
        self._heard_at: dict[int, float] = {}
        self._heard_lock = threading.Lock()
        self._seen: set[tuple[int, int]] = set()
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._posts = Posts()

    def node(self, rank: int) -> str:
        return self.nodes[rank]

    def on(self, kind: str, handler: Handler) -> None:
        """Call ``handler`` for each message of ``kind`` (one handler per kind)."""
        self._handlers[kind] = handler

    def _deliver(self, message: Message) -> None:
        handler = self._handlers.get(message.kind)
        if handler is not None:
            handler(message)

    def _beat(self, peer: int) -> None:
        raise NotImplementedError

    def _send_item(self, dest: int, item: tuple) -> None:
        """Send ``item`` to ``dest``; ChannelGone when it cannot go."""
        raise NotImplementedError

    def exchange(self) -> None:
        """Beat to the watchers."""
        for peer in self.watch.watchers:
            self._beat(peer)

    def heard_at(self) -> dict[int, float]:
        """When each watched rank was last heard (time.monotonic); ``inf`` for one that left
        the job (``leave``): heard from, whatever comes."""
        with self._heard_lock:
            return dict(self._heard_at)

    def _heard(self, source: int, left: bool = False) -> None:
        with self._heard_lock:
            if self._heard_at.get(source) != math.inf:  # a late beat after it left
                self._heard_at[source] = math.inf if left else time.monotonic()

    def send(self, dest: int, kind: str, payload: bytes = b"") -> None:
        self._send_item(dest, (self.rank, None, kind, payload))

    def broadcast(self, kind: str, payload: bytes = b"") -> None:
        """To every other rank; ChannelGone when neither tree could take it."""
        with self._sequence_lock:  # the main, tells and hang threads all broadcast
            self._sequence += 1
            sequence = self._sequence
        item = (self.rank, sequence, kind, payload)
        self._seen.add((self.rank, sequence))
        if not self._pass_on(item) and self.world_size > 1:
            raise ChannelGone(f"no rank took rank {self.rank}'s broadcast")

    def _pass_on(self, item: tuple) -> int:
        """Send a broadcast on to this rank's children in both trees; how many took it. A
        child out of reach is left to the other tree."""
        origin, taken = item[0], 0
        for peer in forwards(self.rank, origin, self.world_size):
            if peer != origin:
                try:
                    self._send_item(peer, item)
                    taken += 1
                except ChannelGone:
                    pass
        return taken

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what this rank sent to be on its way: before it ends,
        which would drop what a transport still holds (the TCP one connects to a child on a
        thread of its own)."""

    def linger(self, seconds: float) -> None:
        """Stay ``seconds`` (another rank is to end first), what this rank sent going out
        meanwhile (``drain``)."""
        until = time.monotonic() + seconds
        self.drain(seconds)
        time.sleep(max(0.0, until - time.monotonic()))

    def post(self, name: str, value: bytes) -> None:
        self._posts.own[name] = value

    def read_many(self, ranks: Sequence[int], name: str,
                  timeout_s: float = READ_S) -> dict[int, bytes | None]:
        """Each of ``ranks``' post ``name`` (None: none, or no answer within ``timeout_s``)."""
        asks = []
        for rank in ranks:
            ask = self._posts.ask()
            asks.append(ask)
            if rank == self.rank:
                self._posts.answer(ask, self._posts.own.get(name))
            else:
                try:
                    self.send(rank, _READ, b"%d %s" % (ask, name.encode()))
                except ChannelGone:
                    self._posts.answer(ask, None)
        return dict(zip(ranks, self._posts.await_answers(asks, timeout_s), strict=True))

    def read(self, rank: int, name: str, timeout_s: float = READ_S) -> bytes | None:
        return self.read_many([rank], name, timeout_s)[rank]

    def _receive(self, item: tuple) -> None:
        origin, sequence, kind, payload = item
        if sequence is not None:  # a broadcast: once, passed on first
            if (origin, sequence) in self._seen:
                return
            self._seen.add((origin, sequence))
            self._pass_on(item)
        if kind == _READ:
            ask, name = payload.decode().split(" ", 1)
            value = self._posts.own.get(name)
            with contextlib.suppress(ChannelGone):  # the asker ended: nobody waits for it
                self.send(origin, _ANSWER, ask.encode() + (
                    b" -" if value is None else b" +" + value))
        elif kind == _ANSWER:
            ask, _, value = payload.partition(b" ")
            self._posts.answer(int(ask), None if value == b"-" else value[1:])
        else:
            self._deliver(Message(origin, kind, payload))
