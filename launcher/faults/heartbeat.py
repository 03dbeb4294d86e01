"""Heartbeats: each rank hears from every other one every second, so a silent one can be named.

A stopped process (SIGSTOP, a node frozen in swap, a hung file system) answers nothing and
raises nothing: only its silence tells. Each rank runs a thread that every ``BEAT_S`` sends a
beat to every other rank and notes when it last heard from each. A rank not heard for
``SILENT_S`` is silent. The ranks' waits ask here, when their timeout passes, whether a peer is
silent (``PeerLost`` naming its rank and node) or alive and busy (writing a checkpoint,
evaluating: the wait goes on, up to ``BUSY_LIMIT`` times the timeout).

Beats travel over the rendezvous store when there is one (gloo, nccl: a counter per rank on a
connection of its own; when the store stops answering, its host, rank 0, is the silent one) or,
with the mpi backend, as MPI messages on a duplicate of ``MPI_COMM_WORLD``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from launcher.core.errors import PeerLost
from launcher.faults import hang_watch
from launcher.faults.c10d_log import quiet_c10d
from launcher.placement.env import JobEnv

#: how often a rank sends its beats and reads the others'
BEAT_S = 1.0
#: a rank not heard for this long is silent: several beats, since a busy interpreter (a long
#: call holding the GIL) delays one now and then
SILENT_S = 5.0
#: a wait whose peers all still beat goes on up to this many times its timeout; past that the
#: ranks are alive but not meeting (collectives called in a different order)
BUSY_LIMIT = 10
#: what to do after a lost peer, wherever it is reported
HINT = ("look at the named node (died, stopped, out of memory, cut off the network); then run "
        "the same command again: it continues from the last checkpoint (launcher.train's "
        "--resume auto, job.resume in a script of your own)")

_KEY = "ddp/heartbeat"
_TAG = 7


class StoreBeats:
    """Beats as counters in the rendezvous store, one key per rank, all read at once."""

    def __init__(self, env: JobEnv, store: dist.Store, node_key: str):
        self._env = env
        self._keys = [f"{_KEY}/{rank}" for rank in range(env.world_size)]
        self._seen: list[bytes] = [b""] * env.world_size
        self._count = 0
        store.set(self._keys[env.rank], "0")
        node_keys = [f"{node_key}/{rank}" for rank in range(env.world_size)]
        store.wait(self._keys + node_keys)
        self.nodes = [value.decode() for value in store.multi_get(node_keys)]
        # the beating thread's own connection: a blocked client holds up its connection
        self._store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                    timeout=timedelta(seconds=SILENT_S))

    def exchange(self) -> set[int]:
        """Beat; the ranks heard since the last call. Raises when the store does not answer."""
        self._count += 1
        self._store.set(self._keys[self._env.rank], str(self._count))
        values = self._store.multi_get(self._keys)
        heard = {rank for rank, value in enumerate(values) if value != self._seen[rank]}
        self._seen = values
        return heard


class MpiBeats:
    """Beats as empty MPI messages on a communicator of their own."""

    def __init__(self, env: JobEnv, world):
        from mpi4py import MPI

        self._mpi = MPI
        self._env = env
        self._comm = world.Dup()  # collective; never matches the training's messages
        self.nodes = self._comm.allgather(env.node_name)
        self._sends: dict[int, object] = {}

    def exchange(self) -> set[int]:
        heard = set()
        status = self._mpi.Status()
        while self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_TAG, status=status):
            heard.add(status.Get_source())
            self._comm.recv(source=status.Get_source(), tag=_TAG)
        for peer in range(self._env.world_size):
            # one beat in flight per peer: a stopped peer's do not pile up
            if peer != self._env.rank and (peer not in self._sends or self._sends[peer].Test()):
                self._sends[peer] = self._comm.isend(b"", dest=peer, tag=_TAG)
        return heard


class Heartbeat:
    """The beating thread and what it heard."""

    def __init__(self, env: JobEnv, beats: StoreBeats | MpiBeats):
        self._env = env
        self._beats = beats
        self.nodes: list[str] = beats.nodes
        now = time.monotonic()
        self._heard = [now] * env.world_size
        #: since when the store does not answer (None: it does, or there is none)
        self._cut_off: float | None = None
        #: when the exchange under way began: a stopped store host never answers, not even
        #: with the client's timeout
        self._calling: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:

        while not self._stop.wait(BEAT_S):
            self._calling = time.monotonic()
            try:
                with quiet_c10d():  # a store that stops answering is reported, not logged
                    heard = self._beats.exchange()
            except Exception:  # noqa: BLE001 - any failure means the same: the store is gone
                # from the call that failed, which may have waited for the store's timeout
                self._cut_off = self._cut_off or self._calling
                continue
            self._cut_off = self._calling = None
            now = time.monotonic()
            for rank in heard:
                self._heard[rank] = now

    def silent(self) -> list[int]:
        """The ranks not heard for SILENT_S; rank 0 alone when its store stopped answering
        before any other rank fell silent."""
        cut_off = self._stalled()
        # while an exchange is under way nobody could be heard: count silence up to its start
        until = cut_off or self._calling or time.monotonic()
        silent = [rank for rank, heard in enumerate(self._heard)
                  if rank != self._env.rank and until - heard > SILENT_S]
        return [0] if not silent and cut_off is not None else silent

    def _stalled(self) -> float | None:
        """Since when beats cannot be exchanged: a call failed, or hangs for SILENT_S."""
        calling = self._calling
        if self._cut_off is None and calling is not None and \
                time.monotonic() - calling > SILENT_S:
            return calling
        return self._cut_off

    def settle(self) -> list[int]:
        """The silent ranks, waiting up to SILENT_S + 2 beats for one to show: just after a
        failure the lost peer has not been silent for long yet."""
        deadline = time.monotonic() + SILENT_S + 2 * BEAT_S
        while not (silent := self.silent()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return silent

    def lost(self, what: str, silent: list[int]) -> PeerLost:
        """``what`` went wrong (a sentence naming this rank), explained by ``silent``."""
        env = self._env
        if self._stalled() is not None and silent == [0]:
            return PeerLost(
                f"{what}: rank 0's rendezvous store at {env.master_addr}:{env.master_port} "
                f"does not answer: rank 0's node ({self.nodes[0]}) is lost, or "
                f"{env.node_name} is cut off", HINT, nodes=(self.nodes[0],))
        names = ", ".join(f"rank {rank} ({self.nodes[rank]})" for rank in silent)
        return PeerLost(f"{what}: no heartbeat for {SILENT_S:.0f} s from {names}", HINT,
                        nodes=tuple(dict.fromkeys(self.nodes[rank] for rank in silent)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * SILENT_S)


_current: Heartbeat | None = None


def current() -> Heartbeat | None:
    """This rank's heartbeat while its process group is up, else None."""
    return _current


def start(env: JobEnv, store: dist.Store | None, node_key: str) -> Heartbeat:
    """Collective: start beating over ``store``, else over MPI."""
    global _current
    if store is not None:
        beats: StoreBeats | MpiBeats = StoreBeats(env, store, node_key)
    else:
        from mpi4py import MPI

        beats = MpiBeats(env, MPI.COMM_WORLD)
    _current = Heartbeat(env, beats)
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def overdue(what: str, elapsed: float, timeout_s: float, rank: int) -> None:
    """A wait for ``what`` passed its timeout: PeerLost naming the silent ranks; none while
    every peer still beats, up to BUSY_LIMIT times the timeout (a peer writing a checkpoint)."""
    beat = current()
    silent = beat.silent() if beat is not None else []
    failed = (f"{what} did not complete within {timedelta(seconds=round(elapsed))} "
              f"(this is rank {rank}{hang_watch.in_call()})")
    watch = hang_watch.current()
    if watch is not None:  # alive but not meeting, or ended: said in one line, exit 4
        watch.await_verdict() if silent else watch.check()
    if silent:
        raise beat.lost(failed, silent)
    if beat is None or elapsed > BUSY_LIMIT * timeout_s:
        raise PeerLost(
            failed + ("" if beat is None else ", although every rank still beats"),
            "a peer stopped early, is stuck, or the ranks called collectives in a different "
            "order; check the other ranks' logs, or raise the timeout (--timeout-s, "
            "init_process_group's timeout)")


def wait_busy(done, timeout_s: float, what: str, rank: int) -> None:
    """Poll ``done()``; past ``timeout_s`` as ``overdue`` allows."""
    start_at = time.monotonic()
    pause = 0.0001
    while not done():
        elapsed = time.monotonic() - start_at
        if elapsed > timeout_s:
            overdue(what, elapsed, timeout_s, rank)
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
