"""Alive but not meeting: when a wait passes its timeout while every peer still beats, the ranks
say where they are over the side channel (``launcher.faults.side_channel``) and rank 0 decides.

- A rank whose wait passed the timeout (``check``; the mpi backend's waits, gloo's failed
  collectives through ``launcher.faults.peer_lost``) asks rank 0 to look, at most once per
  timeout.
- Rank 0 asks every rank where it is (``hang.where?``, one broadcast). Each rank answers from
  a thread of its own: its flight recorder's current call (``launcher.faults.flight_recorder``),
  where its main thread is and the stacks of all its threads (``launcher.faults.stacks``),
  posted as ``hang.where`` first and then written to the hang directory as ``rank-R.txt`` and
  ``rank-R.json`` (``launcher.faults.hang_files``: a slow shared file system delays the files,
  not the answer). A rank that left the job told rank 0 where, on its way out (``ended``); one
  that cannot answer within ``ANSWER_S`` is named as such.
- Rank 0 decides (``launcher.faults.hang_decide``, from ``launcher.faults.hang_diagnosis``'s
  reading of the answers). A line: it writes ``diagnosis.txt`` (with the id of the look,
  which the rank files it was decided from carry) and sends it to every rank; each prints it
  and ends with ``EXIT_HUNG`` (never 3: no node is lost). No line (every rank waits in the
  same call: a long checkpoint write, an evaluation): the wait goes on, looked at again after
  each further timeout, up to ``heartbeat.BUSY_LIMIT`` times it. A rank that fell silent is
  left to the heartbeats (``PeerLost``, exit 3).

The hang directory: ``RUN_DIR/hang`` with a run directory (``launcher.distributed(status_dir=)``,
``launcher.train --run-dir``), else a directory under the temporary directory, on each rank's
own node, that the line names. ``python -m launcher.hang DIR`` reads it again.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from launcher.core.errors import EXIT_HUNG
from launcher.faults import flight_recorder, hang_files, stacks
from launcher.faults.hang_decide import ACK_S, ANSWER_S, Decider, in_thread, say, sent
from launcher.faults.hang_diagnosis import BUSY, ELSEWHERE, ENDED, WAITING, Where
from launcher.faults.record_entry import Entry
from launcher.faults.side_channel import SideChannel

#: how long a rank that asked waits for rank 0's answer before its own report goes on: QUICK_S
#: for rank 0 to start looking (or say there is nothing to look at), VERDICT_S in all
QUICK_S = 3.0
VERDICT_S = ANSWER_S + 5.0
#: the recent calls each rank sends (the whole recorder goes to its file)
HISTORY = 16
DECIDER = 0


class HangWatch:
    """This rank's part: answering where it is; on rank 0 a ``Decider`` too."""

    def __init__(self, channel, run_dir: Path | None, timeout_s: float,
                 silent: Callable[[], list[int]], end: Callable[[int], None],
                 silent_wait_s: float):
        self.channel = channel
        #: the ranks the heartbeats find silent; how this process ends (both passed in: the
        #: heartbeats and fail-fast ask here)
        self._silent, self._end = silent, end
        self.rank = channel.rank
        self._timeout_s = timeout_s
        self._asked_at = -float("inf")
        #: (group, seq) of the call this rank's overdue wait is for: an async op's entry stays
        #: "issued" while its Work is waited on (DDP's gradient buckets wait in C++)
        self._overdue: tuple[str, int] | None = None
        #: the line, once decided or taken: one per job, whoever asks again
        self.verdict: str | None = None
        #: set when rank 0 said there is nothing to tell (a lost peer, a long call)
        self.no_verdict = threading.Event()
        #: set when rank 0 asked where this rank is: a look is under way
        self.looking = threading.Event()
        #: clear while this rank writes its files for a look (after its answer)
        self._written = threading.Event()
        self._written.set()
        channel.on("hang.where?", self._on_where)
        channel.on("hang.verdict", lambda m: in_thread(self._take_verdict, m))
        channel.on("hang.none", lambda m: self.no_verdict.set())
        self._decider = (Decider(self, run_dir, silent, end, silent_wait_s)
                         if self.rank == DECIDER else None)

    def check(self) -> None:
        """A wait passed its timeout: ask rank 0 to look (at most once per timeout)."""
        entry = flight_recorder.current()
        self._overdue = None if entry is None else (entry.group, entry.seq)
        now = time.monotonic()
        if now - self._asked_at < self._timeout_s:
            return
        self._asked_at = now
        self.no_verdict.clear()
        self.looking.clear()
        if self._decider is not None:
            in_thread(self._decider.decide)
        elif not sent(self.channel.send, DECIDER, "hang.check"):
            self.no_verdict.set()  # rank 0, the channel's host, has ended: nobody decides

    def await_verdict(self) -> None:
        """Ask, then wait for rank 0's line (which ends this process) or its word that there is
        none: the caller's own report goes on then."""
        if self.rank != DECIDER and DECIDER in self._silent():
            return  # nobody to decide: the heartbeats report it
        self._asked_at = -float("inf")
        self.check()
        # rank 0 answers at once when the silent ranks did not end; else it asks every rank
        # where it is first, which this rank sees (``looking``)
        start = time.monotonic()
        while not self.no_verdict.wait(0.05):
            waited = time.monotonic() - start
            if waited > VERDICT_S or (waited > QUICK_S and not self.looking.is_set()):
                return

    def ended(self) -> None:
        """This rank leaves the job in order: tell rank 0 where, for ranks that may still wait."""
        if self.rank == DECIDER:
            return
        at, function = stacks.at(sys._getframe(1))
        where = self._where(ENDED, at, function)
        sent(self.channel.send, DECIDER, "hang.ended", json.dumps(where.to_dict()).encode())

    def _where(self, kind: str, at: str, function: str) -> Where:
        entry = flight_recorder.current()
        history = [[e["group"], e["seq"], e["op"], e["where"]]
                   for e in flight_recorder.snapshot()[-HISTORY:]]
        call = {} if entry is None else {k: getattr(entry, k) for k in ("op", "seq", "where",
                                                                        "state", "note")}
        return Where(self.rank, self.channel.node(self.rank), kind, call, history, at, function)

    def _on_where(self, message) -> None:
        self.looking.set()
        in_thread(self.answer, message.payload)

    def answer(self, payload: bytes) -> None:
        """Post where this rank is for the look ``payload`` asks about, then write its files
        (rank 0's ``Decider`` answers for rank 0 through here too)."""
        asked = json.loads(payload)
        directory = Path(asked["dir"])
        entry = flight_recorder.current()
        kind = (WAITING if self._waits_in(entry)
                else BUSY if flight_recorder.is_working() else ELSEWHERE)
        # a waiting rank is where its call is: a failed gloo call has unwound the main thread
        # into the launcher's handlers
        at = (entry.where, entry.function) if kind == WAITING else stacks.main_thread_at()
        where = self._where(kind, *at)
        where.stack = str(directory / f"rank-{self.rank}.txt")
        threads, calls = stacks.all_threads(), flight_recorder.snapshot()
        self._written.clear()
        # the answer first: files on a loaded shared file system (create, fsync, rename) can
        # take longer than rank 0 waits for answers, and this rank would be named as not
        # answering
        sent(self.channel.post, "hang.where", json.dumps({"round": asked["round"],
                                                           "where": where.to_dict()}).encode())
        hang_files.write(directory, asked["look"], where, threads, calls)
        self._written.set()

    def _waits_in(self, entry: Entry | None) -> bool:
        """Whether this rank waits in ``entry``: a call under way, or the issued one whose
        wait passed the timeout (a newer call means that wait ended)."""
        if entry is None:
            return False
        return entry.under_way or (
            entry.state == "issued" and (entry.group, entry.seq) == self._overdue)

    def _take_verdict(self, message) -> None:
        line = message.payload.decode()
        if self.verdict is not None:
            return
        self.verdict = line
        say(self.rank, line)
        self._written.wait(ACK_S / 2)  # its files, before rank 0 ends the job (MPI_Abort)
        sent(self.channel.send, message.source, "hang.ack")
        # rank 0 ends first (MPI_Abort): its status is the job's; meanwhile the verdict passed
        # on to children connected late goes out
        self.channel.linger(ACK_S / 2)
        self._end(EXIT_HUNG)


def in_call() -> str:
    """`` in all_reduce #4 at train.py:8`` while this rank is in a recorded call, else ""."""
    entry = flight_recorder.current()
    if entry is None or not entry.under_way:
        return ""
    return f" in {entry.label()} at {entry.where}"


def start(channel: SideChannel | None, run_dir: Path | None, timeout_s: float,
          silent: Callable[[], list[int]], end: Callable[[int], None],
          silent_wait_s: float) -> HangWatch | None:
    """Watch for hangs over ``channel``, this process's side channel (none: not distributed).
    ``silent``: the ranks the heartbeats find silent, a rank that stopped answering within
    ``silent_wait_s``; ``end``: how to end this process with a status."""
    return None if channel is None else HangWatch(channel, run_dir, timeout_s, silent, end,
                                                  silent_wait_s)
