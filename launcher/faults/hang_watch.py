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
- Rank 0 decides (``launcher.faults.hang_diagnosis``). A line: it writes ``diagnosis.txt`` (with
  the id of the look, which the rank files it was decided from carry) and sends it to every
  rank; each prints it and ends with ``EXIT_HUNG`` (never 3: no node is lost). No line (every
  rank waits in the same call: a long checkpoint write, an evaluation): the wait goes on,
  looked at again after each further timeout, up to ``heartbeat.BUSY_LIMIT`` times it. A
  rank that fell silent is left to the heartbeats (``PeerLost``, exit 3).

The hang directory: ``RUN_DIR/hang`` with a run directory (``launcher.distributed(status_dir=)``,
``launcher.train --run-dir``), else a directory under the temporary directory, on each rank's
own node, that the line names. ``python -m launcher.hang DIR`` reads it again.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from launcher.core.errors import EXIT_HUNG
from launcher.faults import flight_recorder, hang_files, stacks
from launcher.faults.exit_status import record_hang
from launcher.faults.hang_diagnosis import (
    BUSY,
    ELSEWHERE,
    ENDED,
    NO_ANSWER,
    WAITING,
    Where,
    diagnose,
)
from launcher.faults.record_entry import Entry
from launcher.faults.side_channel import ChannelGone, SideChannel

#: how long rank 0 waits for the ranks' answers; one that has not answered by then cannot
ANSWER_S = 5.0
#: how long the ranks take to print the line before rank 0 ends (and with MPI, ends the job)
ACK_S = 5.0
#: how long a rank that asked waits for rank 0's answer before its own report goes on: QUICK_S
#: for rank 0 to start looking (or say there is nothing to look at), VERDICT_S in all
QUICK_S = 3.0
VERDICT_S = ANSWER_S + 5.0
#: how long one read of the answers may wait (they are read again until ANSWER_S)
READ_S = 1.0
#: the recent calls each rank sends (the whole recorder goes to its file)
HISTORY = 16
DECIDER = 0


class HangWatch:
    """This rank's part: answering where it is; on rank 0, deciding."""

    def __init__(self, channel, run_dir: Path | None, timeout_s: float,
                 silent: Callable[[], list[int]], end: Callable[[int], None],
                 silent_wait_s: float):
        self._channel = channel
        #: the ranks the heartbeats find silent; how this process ends (both passed in: the
        #: heartbeats and fail-fast ask here)
        self._silent, self._end = silent, end
        #: how long a rank that does not answer is given to be found silent
        self._silent_wait_s = silent_wait_s
        self.rank = channel.rank
        self._run_dir = run_dir
        self._timeout_s = timeout_s
        self._asked_at = -float("inf")
        self._round = 0
        self._deciding = threading.Lock()
        self._ended: dict[int, Where] = {}
        self._acks = 0
        #: (group, seq) of the call this rank's overdue wait is for: an async op's entry stays
        #: "issued" while its Work is waited on (DDP's gradient buckets wait in C++)
        self._overdue: tuple[str, int] | None = None
        #: the line, once decided or taken: one per job, whoever asks again
        self._verdict: str | None = None
        #: set when rank 0 said there is nothing to tell (a lost peer, a long call)
        self._no_verdict = threading.Event()
        #: set when rank 0 asked where this rank is: a look is under way
        self._looking = threading.Event()
        #: clear while this rank writes its files for a look (after its answer)
        self._written = threading.Event()
        self._written.set()
        channel.on("hang.where?", self._on_where)
        channel.on("hang.verdict", lambda m: _thread(self._take_verdict, m))
        channel.on("hang.none", lambda m: self._no_verdict.set())
        channel.on("hang.ack", self._count_ack)
        if self.rank == DECIDER:
            channel.on("hang.check", lambda m: _thread(self.decide))
            channel.on("hang.ended", self._note_ended)

    # -- any rank ------------------------------------------------------------------------------

    def check(self) -> None:
        """A wait passed its timeout: ask rank 0 to look (at most once per timeout)."""
        entry = flight_recorder.current()
        self._overdue = None if entry is None else (entry.group, entry.seq)
        now = time.monotonic()
        if now - self._asked_at < self._timeout_s:
            return
        self._asked_at = now
        self._no_verdict.clear()
        self._looking.clear()
        if self.rank == DECIDER:
            _thread(self.decide)
        elif not _sent(self._channel.send, DECIDER, "hang.check"):
            self._no_verdict.set()  # rank 0, the channel's host, has ended: nobody decides

    def await_verdict(self) -> None:
        """Ask, then wait for rank 0's line (which ends this process) or its word that there is
        none: the caller's own report goes on then."""
        if self.rank != DECIDER and DECIDER in self._silent():
            return  # nobody to decide: the heartbeats report it
        self._asked_at = -float("inf")
        self.check()
        # rank 0 answers at once when the silent ranks did not end; else it asks every rank
        # where it is first, which this rank sees (``_looking``)
        start = time.monotonic()
        while not self._no_verdict.wait(0.05):
            waited = time.monotonic() - start
            if waited > VERDICT_S or (waited > QUICK_S and not self._looking.is_set()):
                return

    def ended(self) -> None:
        """This rank leaves the job in order: tell rank 0 where, for ranks that may still wait."""
        if self.rank == DECIDER:
            return
        at, function = stacks.at(sys._getframe(1))
        where = self._where(ENDED, at, function)
        _sent(self._channel.send, DECIDER, "hang.ended", json.dumps(where.to_dict()).encode())

    def _where(self, kind: str, at: str, function: str) -> Where:
        entry = flight_recorder.current()
        history = [[e["group"], e["seq"], e["op"], e["where"]]
                   for e in flight_recorder.snapshot()[-HISTORY:]]
        call = {} if entry is None else {k: getattr(entry, k) for k in ("op", "seq", "where",
                                                                        "state", "note")}
        return Where(self.rank, self._channel.node(self.rank), kind, call, history, at, function)

    def _on_where(self, message) -> None:
        self._looking.set()
        _thread(self._answer, message.payload)

    def _answer(self, payload: bytes) -> None:
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
        _sent(self._channel.post, "hang.where", json.dumps({"round": asked["round"],
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
        if self._verdict is not None:
            return
        self._verdict = line
        _print(self.rank, line)
        self._written.wait(ACK_S / 2)  # its files, before rank 0 ends the job (MPI_Abort)
        _sent(self._channel.send, message.source, "hang.ack")
        # rank 0 ends first (MPI_Abort): its status is the job's; meanwhile the verdict passed
        # on to children connected late goes out
        self._channel.linger(ACK_S / 2)
        self._end(EXIT_HUNG)

    def _count_ack(self, message) -> None:
        self._acks += 1

    # -- rank 0 --------------------------------------------------------------------------------

    def _note_ended(self, message) -> None:
        where = Where.from_dict(json.loads(message.payload))
        self._ended[where.rank] = where

    def directory(self) -> Path:
        if self._run_dir is not None:
            return self._run_dir / "hang"
        return Path(tempfile.gettempdir()) / f"ddp-hang-{time.strftime('%Y%m%d-%H%M%S')}"

    def decide(self) -> None:
        """Ask every rank where it is; print and send the line, or say there is none."""
        if self._verdict is not None or not self._deciding.acquire(blocking=False):
            return  # decided, or a look is under way
        try:
            line, directory = self._look()
            if line is not None:
                self._verdict = line
        finally:
            self._deciding.release()
        if line is None:
            self._no_verdict.set()
            _sent(self._channel.broadcast, "hang.none")
            return
        self._end_all(line, directory)

    def _look(self) -> tuple[str | None, Path]:
        silent = set(self._silent())
        directory = self.directory()
        if silent - set(self._ended):
            return None, directory  # the heartbeats report them (PeerLost, exit 3)
        self._looking.set()
        self._round += 1
        # the files of this look carry its id: the hang directory may hold an earlier job's
        look = uuid.uuid4().hex[:12]
        asked = {"round": self._round, "dir": str(directory), "look": look}
        _sent(self._channel.broadcast, "hang.where?", json.dumps(asked).encode())
        self._answer(json.dumps(asked).encode())
        answers = self._answers()
        if self._fall_silent({r for r, a in answers.items() if a is None} - set(self._ended)):
            return None, directory  # it stopped or died while asked: the heartbeats report it
        wheres = []
        for rank, said in sorted(answers.items()):
            if said is not None:
                wheres.append(Where.from_dict(said["where"]))
            elif rank in self._ended:
                wheres.append(self._ended[rank])
                hang_files.write(directory, look, self._ended[rank], "(ended: no stacks)\n")
            elif rank in silent:
                return None, directory  # the heartbeats report it (PeerLost)
            else:
                wheres.append(Where(rank, self._channel.node(rank), NO_ANSWER))
                hang_files.write(directory, look, wheres[-1], "(did not answer: no stacks)\n")
        line = diagnose(wheres)
        if line is not None:
            hang_files.write_diagnosis(directory, look, line)
        return line, directory

    def _fall_silent(self, unanswered: set[int]) -> bool:
        """Whether one of ``unanswered`` is, or within ``silent_wait_s`` becomes, silent to the
        heartbeats. A rank killed just before the question still counts as beating for up to
        SILENT_S; its lost node is the heartbeats' to report (exit 3, requeued without it),
        not a hang of the script (exit 4)."""
        deadline = time.monotonic() + self._silent_wait_s
        while unanswered:
            if unanswered & set(self._silent()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return False

    def _answers(self) -> dict[int, dict | None]:
        """Every rank's answer of this round, None for each one not in within ANSWER_S (a
        post over the store is read as it is: older rounds' and none are asked again)."""
        answers: dict[int, dict | None] = dict.fromkeys(range(self._channel.world_size))
        deadline = time.monotonic() + ANSWER_S
        while (missing := [r for r, a in answers.items() if a is None and r not in self._ended]) \
                and (left := deadline - time.monotonic()) > 0:
            # short reads: one that waits for a rank that cannot answer must not use up the
            # time of one whose answer was not posted yet at the first read
            reads = self._channel.read_many(missing, "hang.where", min(left, READ_S))
            for rank, data in reads.items():
                said = json.loads(data) if data else None
                if said is not None and said["round"] == self._round:
                    answers[rank] = said
            time.sleep(0.1)
        return answers

    def _end_all(self, line: str, directory: Path) -> None:
        _sent(self._channel.broadcast, "hang.verdict", line.encode())
        _print(self.rank, line)
        _print(self.rank, f"HINT: every rank's stacks and last calls are in {directory}; "
               f"python -m launcher.hang {self._run_dir or directory} prints them again")
        if self._run_dir is not None:
            record_hang(self._run_dir, line)
        deadline = time.monotonic() + ACK_S
        expected = self._channel.world_size - 1 - len(self._ended)
        while self._acks < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._acks < expected:  # children connected to late?
            self._channel.drain(max(0.0, deadline - time.monotonic()))
        self._end(EXIT_HUNG)


def in_call() -> str:
    """`` in all_reduce #4 at train.py:8`` while this rank is in a recorded call, else ""."""
    entry = flight_recorder.current()
    if entry is None or not entry.under_way:
        return ""
    return f" in {entry.label()} at {entry.where}"


def _sent(action: Callable, *args) -> bool:
    """One call on the side channel; False when the ranks it was for are out of reach: they
    ended (with a verdict, or the heartbeats name them)."""
    try:
        action(*args)
    except ChannelGone:
        return False
    return True


def _thread(target, *args) -> None:
    threading.Thread(target=target, args=args, name="ddp-hang", daemon=True).start()


def _print(rank: int, line: str) -> None:
    sys.stdout.flush()
    print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def start(channel: SideChannel | None, run_dir: Path | None, timeout_s: float,
          silent: Callable[[], list[int]], end: Callable[[int], None],
          silent_wait_s: float) -> HangWatch | None:
    """Watch for hangs over ``channel``, this process's side channel (none: not distributed).
    ``silent``: the ranks the heartbeats find silent, a rank that stopped answering within
    ``silent_wait_s``; ``end``: how to end this process with a status."""
    return None if channel is None else HangWatch(channel, run_dir, timeout_s, silent, end,
                                                  silent_wait_s)
