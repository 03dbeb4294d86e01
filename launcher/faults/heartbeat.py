"""Heartbeats: each rank is heard by its watchers every second, so a silent one can be named.

A stopped process (SIGSTOP, a node frozen in swap, a hung file system) answers nothing and
raises nothing: only its silence tells. Each rank runs a thread that every ``BEAT_S`` beats to
its two watchers (``launcher.faults.watch``) and notes when it last heard from the ranks it watches.
A rank not heard for ``SILENT_S`` is silent: its watchers tell every rank (one broadcast on the
side channel), so each survivor names every silent rank, not only the ones it watches. The
ranks' waits ask here, when their timeout passes, whether a peer is silent (``PeerLost``
naming its rank and node) or alive and busy (writing a checkpoint, evaluating: the wait goes
on, up to ``BUSY_LIMIT`` times the timeout).

Beats travel on the side channel (``launcher.faults.side_channel``) from rank to rank: over TCP
(gloo, nccl) or, with the mpi backend, as MPI messages. Rank 0 is watched like any other.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta

from launcher.core.errors import PeerLost
from launcher.faults import hang_watch
from launcher.faults.hang_watch import HangWatch
from launcher.faults.side_channel import ChannelGone
from launcher.placement.env import JobEnv

#: how often a rank sends its beats and reads the others'
BEAT_S = 1.0
#: a rank not heard for this long is silent: several beats, since a busy interpreter (a long
#: call holding the GIL) delays one now and then
SILENT_S = 5.0
#: how many beats without news of another silent rank before a survivor names them: the
#: ranks of a lost node are found by different watchers up to two beats apart, told a beat later
QUIET_BEATS = 3
#: how long a rank that stopped answering may take to be found silent and told: the hang
#: watch waits this long before it calls such a rank a hang (``launcher.faults.hang_watch``)
FOUND_SILENT_S = SILENT_S + 2 * BEAT_S
#: a wait whose peers all still beat goes on up to this many times its timeout; past that the
#: ranks are alive but not meeting (collectives called in a different order)
BUSY_LIMIT = 10
#: what to do after a lost peer, wherever it is reported
HINT = ("look at the named node (died, stopped, out of memory, cut off the network); then run "
        "the same command again: it continues from the last checkpoint (launcher.train's "
        "--resume auto, job.resume in a script of your own)")

#: the side channel's kind for "these ranks fell silent", told by their watchers to all
SILENT_KIND = "ddp.silent"


class Heartbeat:
    """The beating thread, what it heard, and what the other watchers told."""

    def __init__(self, env: JobEnv, beats):
        """``beats``: the side channel (``exchange``, ``watch``, ``nodes``, ``on``,
        ``broadcast``)."""
        self._env = env
        self._beats = beats
        self.nodes: list[str] = beats.nodes
        #: the watched ranks count as heard when the heartbeat starts
        self._started = time.monotonic()
        self._watched = beats.watch.watched
        #: the ranks found silent by their watchers: this rank's own finds and those told
        self._told: set[int] = set()
        #: when the last of them was found or told
        self._told_at = -float("inf")
        self._stop = threading.Event()
        beats.on(SILENT_KIND, self._hear_silent)
        self._thread = threading.Thread(target=self._beat, name="ddp-heartbeat", daemon=True)
        self._thread.start()

    def _hear_silent(self, message) -> None:
        self._note_told(json.loads(message.payload))

    def _note_told(self, ranks: list[int]) -> None:
        if set(ranks) - self._told:
            self._told.update(ranks)
            self._told_at = time.monotonic()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(ChannelGone):  # a peer gone: its silence names it
                self._beats.exchange()
            self._tell_silent()

    def _quiet(self) -> list[int]:
        """The watched ranks not heard for SILENT_S."""
        heard, now = self._beats.heard_at(), time.monotonic()
        return [rank for rank in self._watched
                if now - max(heard.get(rank, self._started), self._started) > SILENT_S]

    def _tell_silent(self) -> None:
        """Tell every rank of the watched ones that fell silent since the last beat."""
        found = [rank for rank in self._quiet() if rank not in self._told]
        if found:
            self._note_told(found)
            with contextlib.suppress(Exception):  # the survivors still see what they watch
                self._beats.broadcast(SILENT_KIND, json.dumps(found).encode())

    def silent(self) -> list[int]:
        """The ranks not heard for SILENT_S, by this rank or by their other watchers."""
        silent = set(self._quiet())
        silent.update(rank for rank in self._told if rank != self._env.rank)
        return sorted(silent)

    def settle(self) -> list[int]:
        """The silent ranks once no new one was found for QUIET_BEATS beats, waiting up to
        SILENT_S + 4 beats for the first: just after a failure the lost peer has not been
        silent for long yet, and its watchers' word takes a beat or two more (the watcher's
        next beat, the others' next read). The other ranks of a lost node are found by other
        watchers within a beat or two of the first: a survivor names them all."""
        quiet_s = QUIET_BEATS * BEAT_S
        deadline = time.monotonic() + SILENT_S + 4 * BEAT_S + quiet_s
        seen, changed = self.silent(), -float("inf")
        while True:
            silent, now = self.silent(), time.monotonic()
            if silent != seen:
                seen, changed = silent, now
            # found by this rank's own clock and not yet told: its watchers' news is still due
            news = now if set(silent) - self._told else max(changed, self._told_at)
            if silent and now - news >= quiet_s:
                return silent
            if now > deadline:
                return silent
            time.sleep(0.1)

    def lost(self, what: str, silent: list[int]) -> PeerLost:
        """``what`` went wrong (a sentence naming this rank), explained by ``silent``."""
        names = ", ".join(f"rank {rank} ({self.nodes[rank]})" for rank in silent)
        return PeerLost(f"{what}: no heartbeat for {SILENT_S:.0f} s from {names}", HINT,
                        nodes=tuple(dict.fromkeys(self.nodes[rank] for rank in silent)))

    def leave(self, failed: bool = False) -> None:
        """This rank leaves the job (``failed``: after a failure): no more beats, and its
        watchers told that it left, so that no survivor names it as silent, a lost node."""
        self._stop.set()
        self._beats.leave(failed)

    def close(self) -> None:
        self.leave()
        self._thread.join(timeout=2 * SILENT_S)


# the one process-wide reference to the heartbeat: the waits that ask it (``overdue``) run
# where no caller can hand it over: torch calls the mpi backend's waits (created before the
# heartbeat, with nothing but its options) and the ranks' agreement runs from any stage of the
# training. The process group sets it once its heartbeat and hang watch are up, and clears it.
_waits: tuple[Heartbeat, HangWatch | None] | None = None


def watch_waits(beat: Heartbeat | None, hang: HangWatch | None = None) -> None:
    """Let ``overdue`` ask ``beat`` (and ``hang``, the hang watch) from now on; None: stop."""
    global _waits
    _waits = None if beat is None else (beat, hang)


def watching() -> bool:
    """Whether waits past their timeout ask the heartbeats (``watch_waits``)."""
    return _waits is not None


def overdue(what: str, elapsed: float, timeout_s: float, rank: int) -> None:
    """A wait for ``what`` passed its timeout: PeerLost naming the silent ranks; none while
    every peer still beats, up to BUSY_LIMIT times the timeout (a peer writing a checkpoint)."""
    beat, watch = _waits or (None, None)
    silent = beat.silent() if beat is not None else []
    failed = (f"{what} did not complete within {timedelta(seconds=round(elapsed))} "
              f"(this is rank {rank}{hang_watch.in_call()})")
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
