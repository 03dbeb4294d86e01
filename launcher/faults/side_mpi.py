"""The side channel over MPI (the mpi backend): see ``launcher.faults.side_channel``.

Beats are empty messages to this rank's watchers (``launcher.faults.watch``), one in flight per
watcher so a stopped one's do not pile up. Everything else is one pickled tuple per message;
a thread of the channel's own looks for both every ``MPI_POLL_S`` and hands them to
``SideChannel`` (broadcasts passed on, reads answered, handlers called). MPI
connects lazily, so no rank holds a connection to every other one.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from launcher.faults.side_channel import MPI_POLL_S, ChannelGone, SideChannel
from launcher.placement.env import JobEnv

_BEAT, _MESSAGE, _LEFT = 11, 12, 13
#: how long a rank that leaves waits for its watchers to take its last word
LEAVE_S = 1.0
#: how long a rank that closes its channel waits for the others to close theirs
DRAIN_S = 5.0


class MpiSideChannel(SideChannel):
    """The side channel on a duplicate of ``MPI_COMM_WORLD``."""

    sends_after_failure = False

    def __init__(self, env: JobEnv, world):
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = world.Dup()  # collective; never matches the training's messages
        super().__init__(env, self._comm.allgather(env.node_name))
        self._beats: dict[int, object] = {}
        self._sends: list = []
        self._sends_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="ddp-side-channel", daemon=True)
        self._thread.start()

    def _beat(self, peer: int) -> None:
        with self._gone_on_error():
            if peer not in self._beats or self._beats[peer].Test():
                self._beats[peer] = self._comm.isend(b"", dest=peer, tag=_BEAT)

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

    def _send_item(self, dest: int, item: tuple) -> None:
        with self._sends_lock, self._gone_on_error():
            self._sends = [request for request in self._sends if not request.Test()]
            self._sends.append(self._comm.isend(pickle.dumps(item), dest=dest, tag=_MESSAGE))

    def _pump(self) -> None:
        while not self._closed.wait(MPI_POLL_S):
            self._take(self._handle)

    def _take(self, handle) -> None:
        """Receive every message that has arrived, each handed to ``handle``."""
        status = self._mpi.Status()
        while self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self._mpi.ANY_TAG,
                                status=status):
            source, tag = status.Get_source(), status.Get_tag()
            handle(source, tag, self._comm.recv(source=source, tag=tag))

    def _handle(self, source: int, tag: int, data: bytes) -> None:
        if tag in (_BEAT, _LEFT):
            self._heard(source, left=tag == _LEFT)
        elif tag == _MESSAGE:
            self._receive(pickle.loads(data))

    def close(self) -> None:
        """Stop the pump, then read what the peers sent that nobody took: MPI_Finalize reports
        each unread message (UCX: "unexpected tag-receive descriptor ... was not matched", a
        line per message on every rank of a multi-node job). Past a barrier no peer beats any
        more (each left first); within DRAIN_S, since a peer may be gone or late."""
        self._closed.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            return  # a second reader could take the message the pump probed, and its recv hang
        try:
            with self._gone_on_error():
                everyone = self._comm.Ibarrier()
                deadline = time.monotonic() + DRAIN_S
                while not (met := everyone.Test()) and time.monotonic() < deadline:
                    self._take(_ignore)
                    time.sleep(0.01)
                if not met:
                    everyone.Free()  # it completes without this rank's help
                self._take(_ignore)
        except ChannelGone:
            pass


def _ignore(_source: int, _tag: int, _data: bytes) -> None:
    pass
