"""One rank's TCP connections to the ranks it sends to (``launcher.faults.side_socket``), each
made on first use and kept: its two watchers (made at the start, and checked), its O(log N)
tree neighbours and the few ranks it answers. A rank that refused or reset one is gone from
then on: nothing more is sent to it, and the other broadcast tree carries what it would have.

A send waits for its connection; ``send_later`` does not (a broadcast passed on while the
channel's handler thread must go on: a connection to a lost node's rank waits ``CONNECT_S``),
and ``beat`` drops rather than waits.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

from launcher.faults.side_addresses import Addresses
from launcher.faults.side_channel import ChannelGone

#: a connection not made by then fails: the peer's node is gone, or a firewall drops it
CONNECT_S = 10.0
#: a send not taken by then fails (a peer that has not read for hours: its buffers are full)
SEND_S = 5.0


class Links:
    """The connections out of one rank, by peer rank."""

    def __init__(self, addresses: Addresses):
        self._addresses = addresses
        self._out: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._gone: set[int] = set()
        self._closed = False
        #: what waits to go to ranks being connected to, each rank's in order
        self._pending: dict[int, list[bytes]] = {}
        self._pending_lock = threading.Lock()
        self._sent = threading.Condition(self._pending_lock)

    def lock(self, peer: int) -> threading.Lock:
        """Held while something goes out to ``peer``."""
        with self._locks_lock:
            return self._locks.setdefault(peer, threading.Lock())

    def connected(self, peer: int) -> bool:
        return peer in self._out

    def gone(self, peer: int) -> bool:
        return peer in self._gone

    def connect(self, peer: int) -> None:
        """Connect to ``peer`` now, if not yet; ChannelGone when it cannot be reached."""
        with self.lock(peer):
            self._connection(peer)

    def _connection(self, peer: int) -> socket.socket:
        """The connection to ``peer`` (made now if need be); under ``peer``'s lock."""
        sock = self._out.get(peer)
        if sock is not None:
            return sock
        if peer in self._gone:
            raise ChannelGone(f"rank {peer} is out of reach")
        try:
            sock = socket.create_connection(_split(self._addresses[peer]), timeout=CONNECT_S)
        except OSError as exc:
            self._gone.add(peer)
            raise ChannelGone(str(exc)) from exc
        if self._closed:  # made on a thread of its own as the channel closed
            sock.close()
            raise ChannelGone("the side channel is closed")
        sock.settimeout(SEND_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._out[peer] = sock
        return sock

    def send(self, peer: int, data: bytes) -> None:
        """``data`` to ``peer``, once its connection is made; ChannelGone when it cannot go."""
        with self.lock(peer):
            self._send_locked(peer, data)

    def _send_locked(self, peer: int, data: bytes) -> None:
        sock = self._connection(peer)
        try:
            sock.sendall(data)
        except OSError as exc:  # it ended (reset), or has not read for SEND_S
            sock.close()
            self._out.pop(peer, None)
            self._gone.add(peer)
            raise ChannelGone(f"rank {peer}: {exc}") from exc

    def beat(self, peer: int, data: bytes) -> None:
        """A beat that would wait is dropped, not queued: behind a message still going out to
        ``peer``, or into a full buffer (it reads nothing: stopped). Waiting up to SEND_S
        there would hold this rank's beats to its other watcher too, long enough for that
        one to find this rank silent."""
        lock = self.lock(peer)
        if not lock.acquire(blocking=False):
            return
        try:
            sock = self._out.get(peer)
            if sock is not None and not _writable(sock):
                return
            with contextlib.suppress(ChannelGone):  # ended: this rank's other watcher hears it
                self._send_locked(peer, data)
        finally:
            lock.release()

    def send_later(self, peer: int, data: bytes) -> None:
        """``data`` to ``peer`` on a short-lived thread of its own, after what waits for it
        already; lost if ``peer`` cannot be reached."""
        with self._pending_lock:
            waiting = self._pending.setdefault(peer, [])
            waiting.append(data)
            if len(waiting) > 1:  # a thread is connecting to it, and sends this one next
                return
        threading.Thread(target=self._send_waiting, args=(peer, waiting),
                         name="ddp-side-connect", daemon=True).start()

    def _send_waiting(self, peer: int, waiting: list[bytes]) -> None:
        while True:
            with self._pending_lock:
                if not waiting:
                    del self._pending[peer]
                    self._sent.notify_all()
                    return
                data = waiting[0]
            with contextlib.suppress(ChannelGone):
                self.send(peer, data)
            with self._pending_lock:
                waiting.pop(0)

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what ``send_later`` took to go out (or fail)."""
        with self._sent:
            self._sent.wait_for(lambda: not self._pending, timeout_s)

    def close(self) -> None:
        self._closed = True
        for sock in list(self._out.values()):
            sock.close()
        self._out.clear()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _writable(sock: socket.socket) -> bool:
    """Whether ``sock`` takes a few bytes now (poll: no FD_SETSIZE limit, unlike select)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))
