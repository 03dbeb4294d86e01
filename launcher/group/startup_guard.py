"""A bound on each start-up stage (starting MPI, the rendezvous), kept by a process of its own.

A rank that cannot finish ``MPI_Init_thread`` (a stale shared-memory segment, a network the
MPI cannot use, a peer that failed first) blocks inside it holding the GIL: no Python thread,
timer or signal handler of the rank runs again. So ``guarded(...)`` starts this file as a small
watchdog process (stdlib only, no site packages: it starts in milliseconds) before MPI loads,
and tells it each stage over a pipe. When a stage is not over within its bound, the watchdog
prints one ``error:`` line naming the stage and a ``HINT:``, removes the names of the MPICH
segments the rank maps (``launcher.mpi.segments``), and kills the rank (SIGKILL: status 137).
Every rank has its own, so every rank of a start-up that hangs ends. When the rank dies during a
stage (an MPI that aborts in MPI_Init), the watchdog names the stage it died in. It ends with
the start-up, or as soon as the rank is gone (end of file on the pipe): nothing is left behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

#: added to ``--timeout-s`` for each stage: the rank's own errors for a stage that times out
#: (the store's rendezvous) come first; the watchdog is for a rank that cannot say anything
GRACE_S = 10.0
_BOUND = "the bound is the job's timeout (--timeout-s; launcher.check --timeout) plus 10 s"
#: what to look at when a stage does not finish
HINTS = {
    "starting MPI": (
        "look at the other ranks' errors (one that failed first leaves the rest waiting in "
        "MPI_Init); a stale mpich_shm_* segment in /dev/shm from an aborted job, or a network "
        "the MPI cannot use, also stops it (the MPICH wheel: MPIR_CVAR_CH4_NETMOD=ofi "
        "FI_PROVIDER=tcp), as does Slurm's pmi2 server with a long UCX address (slurmstepd: "
        "'value not properly terminated'; docs/launching.md); " + _BOUND),
    "the rendezvous": (
        "look at the other ranks' errors: a rank that did not arrive, a port taken, or a "
        "host the others cannot reach (MASTER_ADDR, GLOO_SOCKET_IFNAME); " + _BOUND),
}


class Guard:
    """The rank's side of the pipe: ``stage(name)`` starts the clock for a stage (a key of
    ``HINTS``)."""

    def __init__(self, process: subprocess.Popen | None) -> None:
        self._process = process

    def stage(self, name: str) -> None:
        self._send(f"{name}\n")

    def close(self) -> None:
        """The start-up is over (or its failure is reported by the rank): stop watching."""
        self._send("done\n")
        if self._process is not None:
            with suppress(BrokenPipeError):
                self._process.stdin.close()
            self._process.wait()
            self._process = None

    def _send(self, line: str) -> None:
        if self._process is not None:
            # a watchdog ended from outside (SIGTERM to the step) no longer guards: carry on
            with suppress(BrokenPipeError):
                self._process.stdin.write(line.encode())
                self._process.stdin.flush()


@contextmanager
def guarded(who: str, bound_s: float, enabled: bool = True):
    """A ``Guard`` for the body's start-up stages; ``who`` names the rank in the error."""
    process = None
    if enabled:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, str(os.getpid()), str(bound_s), who],
            stdin=subprocess.PIPE, close_fds=True)
    guard = Guard(process)
    try:
        yield guard
    finally:
        guard.close()


def watch(parent: int, bound_s: float, who: str, fd: int) -> int:
    """The watchdog's loop: read stages from ``fd`` until ``done``, end of file or a stage
    that outlasts ``bound_s``."""
    stage, deadline, pending = None, None, b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            _end_rank(parent, who, stage, bound_s)
            return 1
        chunk = os.read(fd, 4096)
        if not chunk:
            if stage is not None:
                _say(who, f"the rank ended while {stage} (look at the MPI library's message "
                     "above)", HINTS.get(stage, ""))
            return 0
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line == b"done":
                return 0
            stage, deadline = line.decode(), time.monotonic() + bound_s


def _end_rank(parent: int, who: str, stage: str, bound_s: float) -> None:
    _say(who, f"{stage} did not finish within {bound_s:.0f} s; the rank is ended",
         HINTS.get(stage, ""))
    _unlink_segments(parent)
    with suppress(ProcessLookupError):
        os.kill(parent, signal.SIGKILL)


def _say(who: str, message: str, hint: str) -> None:
    text = f"[{who}] error: {message}\n" + (f"[{who}] HINT: {hint}\n" if hint else "")
    sys.stderr.write(text)
    sys.stderr.flush()


def _unlink_segments(parent: int) -> None:
    """The MPICH segments the rank maps lose their names, as after a start-up that succeeded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from launcher.mpi import segments as mpi_segments

    try:
        maps = Path(f"/proc/{parent}/maps").read_text()
    except OSError:
        return
    for path in mpi_segments.mapped(maps):
        with suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    # Ctrl-C and the preemption signals reach the whole process group: they are the rank's to
    # handle (the rank's end then ends this loop), not a reason for a traceback here
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    sys.exit(watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.stdin.fileno()))
