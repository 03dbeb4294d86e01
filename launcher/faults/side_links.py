"""One rank's TCP connections to the ranks it sends to (``launcher.faults.side_socket``), each
made on first use and kept: its two watchers (made at the start, and checked), its O(log N)
tree neighbours and the few ranks it answers. A rank that refused or reset one is gone from
then on: nothing more is sent to it, and the other broadcast tree carries what it would have.

A send waits for its connection; ``pass_on`` does not where one must be made first (a
broadcast, which the channel's handler thread must not wait for: a connection to a lost node's
rank waits ``CONNECT_S``), and ``beat`` drops rather than waits.
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
        #: held to add a connection, and to close them all: none is added after ``close``
        self._out_lock = threading.Lock()
        self._closed = False
        #: what waits to go to ranks being connected to, each rank's in order
        self._pending: dict[int, list[bytes]] = {}
        self._pending_lock = threading.Lock()
        self._sent = threading.Condition(self._pending_lock)

    def lock(self, peer: int) -> threading.Lock:
        """Held while something goes out to ``peer``."""
        with self._locks_lock:
            return self._locks.setdefault(peer, threading.Lock())

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
        sock.settimeout(SEND_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._out_lock:
            if self._closed:  # made on a thread of its own as the channel closed
                sock.close()
                raise ChannelGone("the side channel is closed")
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

    def pass_on(self, peer: int, data: bytes) -> bool:
        """``data`` (a broadcast) to ``peer``: now over its connection, else on a short-lived
        thread of its own that connects first, after what waits for ``peer`` already (so
        that nothing overtakes it). False when ``peer`` is out of reach now."""
        if peer in self._gone:
            return False
        with self._pending_lock:
            waiting = self._pending.get(peer)
            if waiting is not None:  # a thread is on it, and sends this one after the others
                waiting.append(data)
                return True
            if peer not in self._out:
                self._pending[peer] = [data]
                threading.Thread(target=self._send_waiting, args=(peer,),
                                 name="ddp-side-connect", daemon=True).start()
                return True
        try:
            self.send(peer, data)
        except ChannelGone:
            return False
        return True

    def _send_waiting(self, peer: int) -> None:
        data = None
        try:
            while True:
                with self._pending_lock:
                    waiting = self._pending[peer]
                    if data is not None:
                        waiting.pop(0)
                    if not waiting:  # done: the next pass_on starts a thread of its own
                        self._done(peer)
                        return
                    data = waiting[0]
                with contextlib.suppress(ChannelGone):
                    self.send(peer, data)
        except BaseException:
            with self._pending_lock:  # what still waits is lost, and nothing waits for it
                self._done(peer)
            raise

    def _done(self, peer: int) -> None:
        """Under the pending lock."""
        self._pending.pop(peer, None)
        self._sent.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what ``pass_on`` left to a thread to go out (or
        fail)."""
        with self._sent:
            self._sent.wait_for(lambda: not self._pending, timeout_s)

    def close(self) -> None:
        with self._out_lock:
            self._closed = True
            socks = list(self._out.values())
            self._out.clear()
        for sock in socks:
            sock.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _writable(sock: socket.socket) -> bool:
    """Whether ``sock`` takes a few bytes now (poll: no FD_SETSIZE limit, unlike select)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))
