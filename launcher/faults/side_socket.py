"""The side channel over TCP, rank to rank (gloo, nccl): see ``launcher.faults.side_channel``.

Each rank listens on a free port of the interface the ranks share (``JobEnv.network``, the
route to rank 0; that interface only) and connects to the ranks it sends to: its two watchers
for the beats, and for messages its O(log N) tree neighbours and the few ranks it answers. A
thread of the channel's own reads what arrives and hands it to ``SideChannel``.
Nothing travels through rank 0 once the channel is open: the rendezvous store is used at the start
only (every rank's address and node, gathered as the nodes are; then whether each rank reached
its watchers) and, rarely, to look up the address of a rank not met yet
(``launcher.faults.side_addresses``).

A stopped rank's kernel still takes what is sent to it, so a beat never blocks on a silent
peer: its silence is what tells. A killed one refuses the connection: sends to it fail, and
the ranks go on with the others. A port that drops connections (a firewall between nodes)
is found at the start, on every rank, with the ranks and the address named.

Beats are taken on the reading thread itself; messages go to a second thread, which passes
broadcasts on, answers reads and calls the handlers: a send that waits for a connection, or a
slow handler, never holds up the beats heard. A broadcast sent or passed on to a rank not
connected to yet goes out on a short-lived thread of its own for that rank: a lost node's
ranks time out their connections (``launcher.faults.side_links``), and neither this rank's
handlers nor the messages after it wait for that.

What travels is frames (``launcher.faults.side_wire``), not pickles: anyone who reaches the
port could send one.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
import time
import traceback

import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults.side_addresses import Addresses
from launcher.faults.side_channel import ChannelGone, SideChannel, forwards, neighbours
from launcher.faults.side_links import Links
from launcher.faults.side_wire import (
    BEAT,
    LEFT,
    MESSAGE,
    decode_item,
    encode_item,
    frame,
    unframe,
)
from launcher.placement import network
from launcher.placement.env import JobEnv

#: the reader's pause after a failed accept, which the listener's next select reports again
_ACCEPT_RETRY_S = 0.05


def reachable_at(env: JobEnv) -> str:
    """The address the other ranks reach this one at: the interface start-up chose, else the
    route to rank 0's address."""
    if env.network is not None and env.network.address:
        return env.network.address
    return network.source_address(env.master_addr)


def _listen(host: str) -> socket.socket:
    """A listening socket on ``host``'s interface only, where ``host`` is this node's; else on
    every interface (an address this node is reached at but does not hold, behind a NAT)."""
    try:
        return socket.create_server((host, 0), backlog=128)
    except OSError:
        return socket.create_server(("", 0), backlog=128)


class SocketSideChannel(SideChannel):
    """The side channel over TCP connections between the ranks."""

    def __init__(self, env: JobEnv, store: dist.Store):
        """Collective. ``store``: the rendezvous', free at this point (NCCL, which blocks its
        client in ``get`` when it builds a communicator, has built none yet): no second
        connection per rank to rank 0, not even at the start."""
        self._env = env
        host = reachable_at(env)
        self._listener = _listen(host)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._addresses = Addresses(env)
        self._links = Links(self._addresses)
        rank = env.rank
        super().__init__(env, self._addresses.publish(store, self.address))
        self._addresses.fetch(store, [peer for peer in dict.fromkeys(
            [*self.watch.watchers, *neighbours(rank, env.world_size), 0]) if peer != rank])
        self._wake, self._woken = socket.socketpair()
        self._inbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        #: the threads that read what arrives and handle the messages (their CPU is measured)
        self.threads = (threading.Thread(target=self._pump, name="ddp-side-channel", daemon=True),
                        threading.Thread(target=self._handle, name="ddp-side-messages",
                                         daemon=True))
        for thread in self.threads:
            thread.start()
        unreached = [self._reach(peer) for peer in self.watch.watchers]
        problems = self._addresses.unreached(
            store, "; ".join(problem for problem in unreached if problem))
        if problems:
            self.close()
            raise LaunchError(
                "the side channel (heartbeats, failure notices) could not connect the ranks: "
                + "; ".join(problems),
                hint="each rank listens on a free TCP port of the interface towards rank 0's "
                "address (as gloo does) and connects to a few other ranks: let the nodes reach "
                "each other on every TCP port (a firewall between them?), or name the "
                "interface the nodes share with --ifname (GLOO_SOCKET_IFNAME)")

    def _reach(self, peer: int) -> str:
        """Connect to ``peer``; what went wrong, or "" when it is reached."""
        try:
            self._links.connect(peer)
        except ChannelGone as exc:
            return (f"rank {self.rank} on {self.node(self.rank)} cannot reach rank {peer} on "
                    f"{self.node(peer)} at {self._addresses.known(peer)}: {exc}")
        return ""

    def _beat(self, peer: int) -> None:
        self._links.beat(peer, frame(self.rank, BEAT, b""))

    def _encode(self, item: tuple) -> bytes:
        return encode_item(
            self.address if item[0] == self.rank else self._addresses.known(item[0]), item)

    def _send_item(self, dest: int, item: tuple) -> None:
        self._links.send(dest, self._encode(item))

    def _pass_on(self, item: tuple) -> int:
        """Send a broadcast on to this rank's children in both trees: at once where a
        connection is open, and on a thread of its own to each child that must be connected
        to first (``Links.pass_on``); how many took it or may still take it. A child out of
        reach is left to the other tree."""
        origin, data = item[0], self._encode(item)
        return sum(self._links.pass_on(peer, data)
                   for peer in forwards(self.rank, origin, self.world_size) if peer != origin)

    def drain(self, timeout_s: float) -> None:
        self._links.drain(timeout_s)

    def leave(self, failed: bool = False) -> None:
        """This rank leaves the job (also after a failure): its watchers count it as heard
        from now on (it ended, it is not lost)."""
        for peer in self.watch.watchers:
            with contextlib.suppress(ChannelGone):
                self._links.send(peer, frame(self.rank, LEFT, b""))

    def _pump(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._woken, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._woken:
                        return
                    if key.fileobj is self._listener:
                        try:
                            conn, _ = self._listener.accept()
                        except OSError:
                            # out of descriptors (EMFILE) or a peer gone before its accept: the
                            # reader must go on; the peer's connect waits in the backlog
                            time.sleep(_ACCEPT_RETRY_S)
                            continue
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ, data=[b""])
                    elif not self._read(key.fileobj, key.data):
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj not in (self._listener, self._woken):
                    key.fileobj.close()
            selector.close()

    def _read(self, conn: socket.socket, buffer: list[bytes]) -> bool:
        """Take what ``conn`` brought; False when it is done (closed, or not speaking frames)."""
        try:
            chunk = conn.recv(65536)
        except OSError:
            return False
        if not chunk:
            return False
        data = buffer[0] + chunk
        try:
            frames, used = unframe(data)
            buffer[0] = data[used:]
            for framed in frames:
                self._take(framed)
        except (ValueError, UnicodeDecodeError):
            return False
        return True

    def _take(self, framed: tuple[int, str, bytes]) -> None:
        source, kind, _ = framed
        if kind in (BEAT, LEFT):
            self._heard(source, left=kind == LEFT)
        elif kind.startswith(MESSAGE):
            address, item = decode_item(framed)
            if address:
                self._addresses.learn(item[0], address)
            self._inbox.put(item)
        else:
            raise ValueError(kind)

    def _handle(self) -> None:
        while (item := self._inbox.get()) is not None:
            try:
                self._receive(item)
            except Exception:  # a handler's bug: said, and the next message still handled
                traceback.print_exc()

    def close(self) -> None:
        reading, handling = self.threads
        if reading.is_alive():
            self._wake.send(b"x")
            reading.join(timeout=5)
        self._inbox.put(None)
        handling.join(timeout=5)
        self._links.close()
        for sock in (self._listener, self._wake, self._woken):
            sock.close()
        self._addresses.close()

