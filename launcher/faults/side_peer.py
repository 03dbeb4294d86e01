"""What both side-channel transports share: messages from rank to rank, no rank in the middle.

A subclass moves bytes: ``_beat`` (to one watcher), ``_send_item`` (one message to one rank)
and calls ``_heard`` and ``_receive`` for what arrives, on a thread of its own. Here: the
beats heard, broadcasts passed on along two binomial trees rooted at their origin (O(log N)
hops; a rank that stopped inside one tree leaves the other one to carry it), and posts read by
asking their rank. Each rank talks to its watchers, the ranks it watches, its O(log N) tree
neighbours (``neighbours``) and the ranks it answers: no rank holds a connection to every
other one, and none serves more than its share.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from launcher.faults import watch
from launcher.faults.side_channel import (
    READ_S,
    ChannelGone,
    Message,
    Posts,
    SideChannel,
    forwards,
)
from launcher.placement.env import JobEnv

#: the channel's own kinds: a read of a post ("ASK NAME"), and its answer ("ASK -" for none,
#: "ASK +VALUE"): no pickles, since anyone who reaches a TCP transport's port can send one
_READ, _ANSWER = "ddp.read", "ddp.answer"


def neighbours(rank: int, size: int) -> list[int]:
    """Every rank that ``rank`` may pass a broadcast on to, whatever its origin: a binomial
    tree's children lie 2**k positions away, up or down."""
    found, step = {}, 1
    while step < size:
        found.update(dict.fromkeys(((rank + step) % size, (rank - step) % size)))
        step *= 2
    found.pop(rank, None)
    return list(found)


class PeerSideChannel(SideChannel):
    """Beats, messages, broadcasts and posts over a transport that reaches any rank."""

    def __init__(self, env: JobEnv, nodes: Sequence[str]):
        super().__init__(env, nodes)
        self.watch = watch.watch(self.nodes, env.rank)
        self._heard_now: set[int] = set()
        #: the watched ranks that left the job (``leave``): heard from, whatever comes
        self._left: set[int] = set()
        self._heard_lock = threading.Lock()
        self._seen: set[tuple[int, int]] = set()
        self._sequence = 0
        self._posts = Posts()

    def _beat(self, peer: int) -> None:
        raise NotImplementedError

    def _send_item(self, dest: int, item: tuple) -> None:
        """Send ``item`` to ``dest``; ChannelGone when it cannot go."""
        raise NotImplementedError

    def exchange(self) -> set[int]:
        """Beat to the watchers; the watched ranks heard since the last call."""
        for peer in self.watch.watchers:
            self._beat(peer)
        with self._heard_lock:
            heard, self._heard_now = self._heard_now, set()
            return heard | self._left

    def _heard(self, source: int, left: bool = False) -> None:
        with self._heard_lock:
            (self._left if left else self._heard_now).add(source)

    def send(self, dest: int, kind: str, payload: bytes = b"") -> None:
        self._send_item(dest, (self.rank, None, kind, payload))

    def broadcast(self, kind: str, payload: bytes = b"") -> None:
        """To every other rank; ChannelGone when neither tree could take it."""
        self._sequence += 1
        item = (self.rank, self._sequence, kind, payload)
        self._seen.add((self.rank, self._sequence))
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

    def post(self, name: str, value: bytes) -> None:
        self._posts.own[name] = value

    def read_many(self, ranks, name, timeout_s=READ_S):
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
