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

Both send from rank to rank (``launcher.faults.side_peer``): a beat goes to this rank's two
watchers only, a broadcast travels along two binomial trees rooted at its origin (O(log N)
hops; a rank that stopped inside one tree leaves the other one to carry it), and a post is
read by asking its rank.

Handlers (``on``) run on a thread of the channel's own: they must return quickly. A call that
cannot reach the others raises ``ChannelGone``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launcher.placement.env import JobEnv

#: how often the MPI transport looks for messages (each look is one MPI_Iprobe)
MPI_POLL_S = 0.05
#: what a ``read`` of another rank's post waits for by default
READ_S = 5.0


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


class SideChannel:
    """What both transports share: handlers, and the nodes of the ranks."""

    def __init__(self, env: JobEnv, nodes: Sequence[str]):
        self.rank = env.rank
        self.world_size = env.world_size
        #: every rank's node (``JobEnv.node_name``), in rank order
        self.nodes = list(nodes)
        self._handlers: dict[str, Handler] = {}

    def node(self, rank: int) -> str:
        return self.nodes[rank]

    def on(self, kind: str, handler: Handler) -> None:
        """Call ``handler`` for each message of ``kind`` (one handler per kind)."""
        self._handlers[kind] = handler

    def _deliver(self, message: Message) -> None:
        handler = self._handlers.get(message.kind)
        if handler is not None:
            handler(message)

    def read_many(self, ranks: Sequence[int], name: str,
                  timeout_s: float = READ_S) -> dict[int, bytes | None]:
        return {rank: self.read(rank, name, timeout_s) for rank in ranks}

    def read(self, rank: int, name: str, timeout_s: float = READ_S) -> bytes | None:
        return self.read_many([rank], name, timeout_s)[rank]


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
