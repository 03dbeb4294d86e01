"""Each rank's output kept in a file of its own, and labelled in the job log.

Under srun and mpiexec every rank's stdout and stderr meet in one job log. While a rank runs
with a run directory, whatever Python writes to ``sys.stdout`` and ``sys.stderr`` also goes to
``RUN_DIR/logs/rank-R.log`` (appended: a requeued job's attempts follow each other, each from a
line that says when, where and of how many ranks), and in a job of several ranks every line of
a rank other than 0 is shown in the job log as ``[node:rank] line``. Rank 0's lines stay as
they are: they are the job's progress, quoted by the docs and read by people and tests.

Each write goes to both places at once, so a rank that dies leaves nothing unwritten; output
written to the file descriptors themselves (MPI's and NCCL's messages, faulthandler's
tracebacks, ``job.print(every_rank=True)``, which labels its lines ``[rank R]``) goes to the
job log only.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from launcher.core.errors import LaunchError
from launcher.core.run_files import LOGS_DIR


def log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / LOGS_DIR / f"rank-{rank}.log"


class _Tee(io.TextIOBase):
    """A text stream that writes to ``inner`` (labelled by ``prefix``) and to ``log``."""

    def __init__(self, inner: TextIO, log: TextIO, prefix: str):
        self._inner, self._log, self._prefix = inner, log, prefix
        self._pending = ""
        # the heartbeat's and fail-fast's threads write too (a lost peer, another's failure)
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._write(text)
        return len(text)

    def _write(self, text: str) -> None:
        self._log.write(text)
        self._log.flush()
        if not self._prefix:
            # as it is, partial lines too (a progress bar redrawn with \r), but out only with
            # a line's end or a redraw, in one write: print() writes a line and its newline
            # apart, stderr sends each write at once (unbuffered), and sent apart, another
            # rank's line may land between the two in the job log
            self._pending += text
            if "\n" in text or "\r" in text:
                self._send_pending()
            return
        # whole lines in one write: under mpiexec that keeps another rank's out of them
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self._inner.write("".join(f"{self._prefix}{line}\n" for line in lines))
        self._inner.flush()

    def _send_pending(self) -> None:
        if self._pending:
            self._inner.write(self._pending)
            self._pending = ""
        self._inner.flush()

    def flush(self) -> None:
        self._log.flush()
        if self._prefix:
            self._inner.flush()
            return
        with self._lock:  # rank 0's partial line, asked for (a prompt printed with end="")
            self._send_pending()

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        # what writes to the descriptor itself (faulthandler, job.print's whole lines, a child
        # process) reaches the job log as before, without a copy or a label
        return self._inner.fileno()

    @property
    def buffer(self):
        return self._inner.buffer

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self._inner, "encoding", "utf-8")

    def finish(self) -> TextIO:
        """The inner stream, after the rest of a partial line."""
        if not self._prefix:
            self.flush()
        elif self._pending:
            self._inner.write(f"{self._prefix}{self._pending}\n")
            self._inner.flush()
        return self._inner


@contextmanager
def teed(run_dir: Path, rank: int, world_size: int, node: str) -> Iterator[Path]:
    """``sys.stdout`` and ``sys.stderr`` also to the rank's log file while the body runs. When
    the body raises, the process is ending: its last words (the error the caller prints) still
    go to both, so the streams stay teed."""
    path = log_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("a", encoding="utf-8")
    except OSError as exc:
        raise LaunchError(f"cannot write this rank's log {path}: {exc.strerror}",
                          hint="pass a run directory every rank can write") from None
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log.write(f"--- {stamp} rank {rank} of {world_size} on {node}, pid {os.getpid()} ---\n")
    prefix = f"[{node}:{rank}] " if world_size > 1 and rank != 0 else ""
    sys.stdout.flush()
    sys.stderr.flush()
    out, err = _Tee(sys.stdout, log, prefix), _Tee(sys.stderr, log, prefix)
    sys.stdout, sys.stderr = out, err
    yield path
    sys.stdout, sys.stderr = out.finish(), err.finish()
    log.close()
