"""Heartbeats: each rank is heard by its watchers every second, so a silent one can be named.

A stopped process (SIGSTOP, a node frozen in swap, a hung file system) answers nothing and
raises nothing: only its silence tells. Each rank runs a thread that every ``BEAT_S`` beats to
its two watchers (``launcher.faults.watch``) and notes when it last heard from the ranks it watches.
A rank not heard for ``SILENT_S`` is silent: its watchers tell every rank (one broadcast on the
side channel, renewed every ``RENEW_S`` while it stays silent), so each survivor names every
silent rank, not only the ones it watches. A silent rank can come back (out of swap, SIGCONT):
its watchers then tell every rank that it is heard again, and a tell not renewed lapses after
``TELL_S``, so that nobody names it later in the job. A watcher that leaves the job (most
often after a failure, once it named the silent ranks itself) tells its last word: the ranks it
found silent, kept by every rank until they are heard again, since nobody renews that tell; a
rank whose own collective fails later still names them. Tells go out on a thread of their own:
a broadcast waiting on a peer (a connection to a lost node's rank that times out) never holds
up this rank's beats. A watcher frozen itself judges nobody until it has read the beats that
came meanwhile. The ranks' waits ask here, when their
timeout passes, whether a peer is silent (``PeerLost`` naming its rank and node) or alive and
busy (writing a checkpoint, evaluating: the wait goes on, up to ``BUSY_LIMIT`` times the
timeout).

Beats travel on the side channel (``launcher.faults.side_channel``) from rank to rank: over TCP
(gloo, nccl) or, with the mpi backend, as MPI messages. Rank 0 is watched like any other.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
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
#: how long a tell that a rank is silent holds unless its watchers renew it (each beat while it
#: stays silent): long enough to outlast a watcher's beat held up a few seconds (a broadcast
#: waiting on a connection), short enough that a rank whose word "heard again" was lost or
#: overtaken is not named long after it came back
TELL_S = 2 * SILENT_S
#: how often a watcher renews its tell while the rank stays silent: twice per TELL_S, not each
#: beat, so that a lost rack of K ranks costs every rank about 2K/RENEW_S messages a second
RENEW_S = TELL_S / 2
#: a beating thread that wakes this much later than BEAT_S was frozen with its process
#: (SIGSTOP, swap) or starved of the GIL: the beats that came meanwhile still wait to be read
LATE_S = 2 * BEAT_S
#: how long a rank that leaves waits for its last word to go out (a peer out of reach holds it)
LAST_WORD_S = 2 * BEAT_S
#: what to do after a lost peer, wherever it is reported
HINT = ("look at the named node (died, stopped, out of memory, cut off the network); then run "
        "the same command again: it continues from the last checkpoint (launcher.train's "
        "--resume auto, job.resume in a script of your own)")

#: the side channel's kinds for "these ranks are silent" (renewed every RENEW_S while they
#: stay so), "these ranks are heard again", and a leaving watcher's last word ("these ranks are
#: silent", kept until heard again), told by the watchers to all
SILENT_KIND, HEARD_KIND, LAST_KIND = "ddp.silent", "ddp.heard", "ddp.silent.last"


class Heartbeat:
    """The beating thread, what it heard, and what the other watchers told."""

    def __init__(self, env: JobEnv, beats):
        """``beats``: the side channel (``exchange``, ``watch``, ``nodes``, ``on``,
        ``broadcast``, ``drain``, ``leave``, ``sends_after_failure``)."""
        self._env = env
        self._beats = beats
        self.nodes: list[str] = beats.nodes
        #: the watched ranks count as heard from then: the start, or when this process woke
        #: from a freeze (``_beat``)
        self._since = time.monotonic()
        #: when the beating thread began its wait for the next beat; None while it beats
        self._asleep_at: float | None = None
        self._watched = beats.watch.watched
        #: the ranks found silent by their watchers, this rank's own finds and those told,
        #: each with when its tell lapses unless renewed
        self._told: dict[int, float] = {}
        #: when the last of them was newly found or told
        self._told_at = -math.inf
        #: the watched ranks this rank told silent, until it tells that they are heard again
        self._reported: set[int] = set()
        #: when this rank last told the ranks it reports (a new one is told at once)
        self._renewed_at = -math.inf
        self._stop = threading.Event()
        self._left = False
        #: the tells waiting to go out, in order; None: no more
        self._tells: queue.SimpleQueue[tuple[str, list[int]] | None] = queue.SimpleQueue()
        beats.on(SILENT_KIND, self._hear_silent)
        beats.on(LAST_KIND, self._hear_last)
        beats.on(HEARD_KIND, self._hear_back)
        self._thread = threading.Thread(target=self._beat, name="ddp-heartbeat", daemon=True)
        self._teller = threading.Thread(target=self._send_tells, name="ddp-heartbeat-tells",
                                        daemon=True)
        self._thread.start()
        self._teller.start()

    def _hear_silent(self, message) -> None:
        self._note_told(json.loads(message.payload))

    def _hear_last(self, message) -> None:
        self._note_told(json.loads(message.payload), for_good=True)

    def _hear_back(self, message) -> None:
        self._forget(json.loads(message.payload))

    def _note_told(self, ranks, for_good: bool = False) -> None:
        now = time.monotonic()
        hold_s = math.inf if for_good else TELL_S
        if any(self._told.get(rank, -math.inf) <= now for rank in ranks):  # a renewal is no news
            self._told_at = now
        for rank in ranks:
            self._told[rank] = max(self._told.get(rank, -math.inf), now + hold_s)

    def _forget(self, ranks) -> None:
        for rank in ranks:
            self._told.pop(rank, None)

    def _told_now(self) -> set[int]:
        now = time.monotonic()
        return {rank for rank, lapses in list(self._told.items()) if lapses > now}

    def _beat(self) -> None:
        while True:
            self._asleep_at = asleep = time.monotonic()
            stopped = self._stop.wait(BEAT_S)
            woke, self._asleep_at = time.monotonic(), None
            if stopped:
                return
            if woke - asleep > BEAT_S + LATE_S:
                self._since = woke  # judge nobody before the beats queued meanwhile are read
            with contextlib.suppress(ChannelGone):  # a peer gone: its silence names it
                self._beats.exchange()
            self._tell_silent()

    def _unheard(self, heard: dict[int, float], now: float, since: float) -> set[int]:
        """The watched ranks not heard for SILENT_S, counting each as heard at ``since``."""
        return {rank for rank in self._watched
                if now - max(heard.get(rank, since), since) > SILENT_S}

    def _quiet(self) -> set[int]:
        """The watched ranks not heard for SILENT_S; none while the beating thread oversleeps:
        this process was frozen, and what it heard meanwhile is not read yet."""
        heard, now, asleep = self._beats.heard_at(), time.monotonic(), self._asleep_at
        if asleep is not None and now - asleep > BEAT_S + LATE_S:
            return set()
        return self._unheard(heard, now, self._since)

    def _tell_silent(self) -> None:
        """Tell every rank which watched ranks are silent (at once when one is new, then every
        RENEW_S, which renews the tell), and which of those told before are heard again: one
        message per watcher of a silent rank, none while every rank beats."""
        heard, now = self._beats.heard_at(), time.monotonic()
        back = self._reported - self._unheard(heard, now, -math.inf)  # beats heard, or left
        quiet = self._quiet()
        new = quiet - self._reported
        self._reported = (self._reported - back) | quiet
        if new or (quiet and now - self._renewed_at >= RENEW_S):
            self._renewed_at = now
            self._note_told(quiet)
            self._tell(SILENT_KIND, quiet)
        if back:
            self._forget(back)
            self._tell(HEARD_KIND, back)

    def _tell(self, kind: str, ranks: set[int]) -> None:
        self._tells.put((kind, sorted(ranks)))

    def _send_tells(self) -> None:
        while (tell := self._tells.get()) is not None:
            kind, ranks = tell
            with contextlib.suppress(Exception):  # the survivors still see what they watch
                self._beats.broadcast(kind, json.dumps(ranks).encode())

    def silent(self) -> list[int]:
        """The ranks not heard for SILENT_S, by this rank or by their other watchers; a rank
        this rank watches and hears is not silent, whatever it was told (a watcher that left
        said so, and nobody takes a last word back)."""
        heard, now = self._beats.heard_at(), time.monotonic()
        hears = {rank for rank in self._watched if now - heard.get(rank, -math.inf) <= SILENT_S}
        silent = self._quiet() | (self._told_now() - hears)
        silent.discard(self._env.rank)
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
            news = now if set(silent) - self._told_now() else max(changed, self._told_at)
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
        """This rank leaves the job (``failed``: after a failure): no more beats; every rank
        told the ranks it found silent, for good (nobody renews the tell now), and its
        watchers that it left, so that no survivor names it as silent, a lost node."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        self._thread.join(timeout=LAST_WORD_S)  # its last finds are in _reported, or told
        if self._reported and (self._beats.sends_after_failure or not failed):
            self._tell(LAST_KIND, self._reported)
        self._tells.put(None)
        self._teller.join(timeout=LAST_WORD_S)
        self._beats.drain(LAST_WORD_S)
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
