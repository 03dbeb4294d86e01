"""Rank 0's part of the hang watch (``launcher.faults.hang_watch``): asking every rank where it
is, deciding from the answers (``launcher.faults.hang_diagnosis``), and ending the job with the
line; and the side-channel calls both parts make.

A rank that left the job told rank 0 where, on its way out (``hang.ended``); one that cannot
answer within ``ANSWER_S`` is named as such, unless the heartbeats find it silent meanwhile: a
lost node is theirs to report (exit 3), not a hang of the script (exit 4).
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
from launcher.faults import hang_files
from launcher.faults.exit_status import record_hang
from launcher.faults.hang_diagnosis import NO_ANSWER, Where, diagnose
from launcher.faults.side_channel import ChannelGone

#: how long rank 0 waits for the ranks' answers; one that has not answered by then cannot
ANSWER_S = 5.0
#: how long the ranks take to print the line before rank 0 ends (and with MPI, ends the job)
ACK_S = 5.0
#: how long one read of the answers may wait (they are read again until ANSWER_S)
READ_S = 1.0


class Decider:
    """Rank 0's looks: ``watch`` is its own rank's part, which answers for rank 0 too and
    holds what both parts share (the line once decided, whether a look is under way)."""

    def __init__(self, watch, run_dir: Path | None, silent: Callable[[], list[int]],
                 end: Callable[[int], None], silent_wait_s: float):
        self._watch = watch
        self._channel = watch.channel
        self._run_dir = run_dir
        self._silent, self._end = silent, end
        self._silent_wait_s = silent_wait_s
        self._round = 0
        self._deciding = threading.Lock()
        self._ended: dict[int, Where] = {}
        self._acks = 0
        self._channel.on("hang.check", lambda m: in_thread(self.decide))
        self._channel.on("hang.ended", self._note_ended)
        self._channel.on("hang.ack", self._count_ack)

    def _note_ended(self, message) -> None:
        where = Where.from_dict(json.loads(message.payload))
        self._ended[where.rank] = where

    def _count_ack(self, message) -> None:
        self._acks += 1

    def directory(self) -> Path:
        if self._run_dir is not None:
            return self._run_dir / "hang"
        return Path(tempfile.gettempdir()) / f"ddp-hang-{time.strftime('%Y%m%d-%H%M%S')}"

    def decide(self) -> None:
        """Ask every rank where it is; print and send the line, or say there is none."""
        watch = self._watch
        if watch.verdict is not None or not self._deciding.acquire(blocking=False):
            return  # decided, or a look is under way
        try:
            line, directory = self._look()
            if line is not None:
                watch.verdict = line
        finally:
            self._deciding.release()
        if line is None:
            watch.no_verdict.set()
            sent(self._channel.broadcast, "hang.none")
            return
        self._end_all(line, directory)

    def _look(self) -> tuple[str | None, Path]:
        silent = set(self._silent())
        directory = self.directory()
        if silent - set(self._ended):
            return None, directory  # the heartbeats report them (PeerLost, exit 3)
        self._watch.looking.set()
        self._round += 1
        # the files of this look carry its id: the hang directory may hold an earlier job's
        look = uuid.uuid4().hex[:12]
        asked = json.dumps({"round": self._round, "dir": str(directory), "look": look}).encode()
        sent(self._channel.broadcast, "hang.where?", asked)
        self._watch.answer(asked)
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
        sent(self._channel.broadcast, "hang.verdict", line.encode())
        say(self._channel.rank, line)
        say(self._channel.rank, f"HINT: every rank's stacks and last calls are in {directory}; "
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


def sent(action: Callable, *args) -> bool:
    """One call on the side channel; False when the ranks it was for are out of reach: they
    ended (with a verdict, or the heartbeats name them)."""
    try:
        action(*args)
    except ChannelGone:
        return False
    return True


def in_thread(target, *args) -> None:
    threading.Thread(target=target, args=args, name="ddp-hang", daemon=True).start()


def say(rank: int, line: str) -> None:
    sys.stdout.flush()
    print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
