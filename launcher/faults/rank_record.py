"""A record of each running rank in the run directory: the witness of how a rank ended when
the rank itself could not say.

A rank that is killed (SIGKILL, the OOM killer, its node lost) writes nothing. A survivor may
die too before it names the lost node: the MPICH wheel's UCX netmod segfaults in the next call
that touches a dead peer (seen in ``MPI_Isend`` and ``MPI_Test``, over TCP as well as shared
memory). So each rank keeps ``<run-dir>/ranks/<rank>`` while it runs:

- its first line is the rank's node, as Slurm names it (``JobEnv.node_name``);
- Python's faulthandler appends a traceback when a fatal signal (SIGSEGV, SIGABRT, SIGBUS,
  SIGFPE, SIGILL) ends the rank: more than one line means "crashed";
- on each node one rank (local rank 0) touches its record every ``TOUCH_S``: the newest
  record of a node tells when that node was last known alive (or when a rank of it crashed).
  One touch per node, not per rank: on a parallel file system each touch is a metadata
  operation on the run directory's metadata server;
- every ending that Python sees removes it (exit statuses go to ``launcher.faults.exit_status``).

What is left after a failed step tells the batch script (``ddp_tasks.batch_endings``) which
nodes went quiet first; they are lost. Standard library only.
"""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from launcher.core.run_files import RANK_RECORDS_DIR

#: how often each node's record is touched: one metadata write per node per interval on the
#: run directory's file system. A Lustre or GPFS metadata server serves some 10,000s of
#: operations per second for every job on the cluster; 15 s keeps a job of 1,000 nodes at 67
#: per second (10,000 ranks on 1,250 nodes: 83), under 100
TOUCH_S = 15.0


class RankRecord:
    """This rank's record, open while it runs; nothing when the run directory is unwritable
    (the job's own checks report that)."""

    def __init__(self, run_dir: Path, rank: int, node: str, touches: bool = True):
        self._path = run_dir / RANK_RECORDS_DIR / str(rank)
        self._stop = threading.Event()
        self._faulthandler_was_on = faulthandler.is_enabled()
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "w", encoding="utf-8")  # noqa: SIM115 - kept open
            self._file.write(f"{node}\n")
            self._file.flush()
        except OSError:
            self._file = None
            return
        faulthandler.enable(self._file, all_threads=True)
        self._thread = None
        if touches:
            self._thread = threading.Thread(target=self._touch, name="ddp-rank-record",
                                            daemon=True)
            self._thread.start()

    def _touch(self) -> None:
        while not self._stop.wait(TOUCH_S):
            with suppress(OSError):
                os.utime(self._file.fileno())

    def close(self) -> None:
        """This rank ended through Python: no record."""
        if self._file is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        faulthandler.disable()
        if self._faulthandler_was_on:  # PYTHONFAULTHANDLER, or a script's own
            faulthandler.enable()
        self._file.close()
        self._file = None
        with suppress(OSError):
            self._path.unlink()
            self._path.parent.rmdir()  # the last rank to end leaves no empty directory


@contextmanager
def kept(run_dir: Path, rank: int, node: str, touches: bool = True) -> Iterator[None]:
    """Keep this rank's record while the body runs; ``touches``: this rank keeps its node's
    time (local rank 0)."""
    record = RankRecord(run_dir, rank, node, touches)
    try:
        yield
    finally:
        record.close()
