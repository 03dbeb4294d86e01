"""One kind of user-facing error: a cause and a fix, printed the same way on every rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class LaunchError(Exception):
    """An error the user can fix: ``message`` names the cause, ``hint`` the fix.

    Entry points catch it, print it without a traceback and exit with ``EXIT_USER_ERROR``.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        text = f"error: {self.message}"
        if self.hint:
            text += f"\nHINT: {self.hint}"
        return text


#: exit status for errors the user can fix (bad input, bad environment)
EXIT_USER_ERROR = 2

#: exit status when a peer was lost mid-job (node died, network cut, a rank stuck): rerun,
#: and ``--resume auto`` continues from the last checkpoint
EXIT_PEER_LOST = 3

#: exit status when the ranks are alive but do not meet (collectives called in a different
#: order, a rank that ended or is stuck elsewhere while the others wait): one line on every
#: rank says who is where (``launcher.faults.hang_watch``). A bug in the script, not a lost
#: node: rerunning will not help, and batch scripts pass it on without requeueing
EXIT_HUNG = 4

#: exit status when a rank raised an exception nobody handled (a bug in a model, a dataset, a
#: script): on that rank after its traceback, on every other rank after one line naming it
#: (``launcher.faults.failfast``). sysexits' EX_SOFTWARE: rerunning will not help
EXIT_RANK_FAILED = 70

#: exit status after a preemption signal was handled and a checkpoint saved: sysexits'
#: EX_TEMPFAIL ("try again later"); batch scripts turn it into ``scontrol requeue``
EXIT_PREEMPTED = 75

#: exit status after Ctrl-C (SIGINT): 128 + 2, what a shell reports for a process SIGINT ended,
#: so scripts treat it as "stopped on purpose", never as a requeue or bad input
EXIT_INTERRUPTED = 130


def raised_everywhere(error: BaseException) -> bool:
    """Whether every rank raises ``error`` together (so no rank must be told of it)."""
    return getattr(error, "everywhere", False)


class RankFailed(Exception):
    """This rank failed and has said so (its traceback, a notice to its peers): end the process
    with ``status`` at once, without tearing down what its peers may still block in."""

    def __init__(self, status: int):
        super().__init__(f"exit {status}")
        self.status = status


class Preempted(Exception):
    """Raised once the ranks have agreed to stop and the checkpoint is written."""

    #: on every rank at once (``raised_everywhere``)
    everywhere = True

    def __init__(self, checkpoint: str, status: int = EXIT_PREEMPTED):
        super().__init__(f"stopped with exit {status}; checkpoint {checkpoint}")
        self.checkpoint = checkpoint
        #: ``EXIT_PREEMPTED``, or ``EXIT_INTERRUPTED`` after Ctrl-C
        self.status = status


class PeerLost(LaunchError):
    """Communication with another rank failed or timed out.

    ``nodes``: the node names (``JobEnv.node_name``) of the ranks that stopped answering, empty
    when unknown; batch scripts exclude them from the next attempt. The process must then exit
    at once: a normal exit runs ``MPI_Finalize`` (mpi4py registers it), which waits for the
    lost rank forever.
    """

    def __init__(self, message: str, hint: str | None = None, nodes: tuple[str, ...] = ()):
        super().__init__(message, hint)
        self.nodes = tuple(nodes)


def report_and_exit(error: LaunchError, rank: int | None = None,
                    end: Callable[[int], None] = os._exit) -> None:
    """Print ``error`` on stderr, prefixed with the rank when known, and exit non-zero; a lost
    peer through ``end`` (in a rank under mpiexec or mpirun: ``MPI_Abort``, so that the
    launcher's status is 3 and not the signal of the ranks it then kills)."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    for line in str(error).splitlines():
        print(f"{prefix}{line}", file=sys.stderr, flush=True)
    if isinstance(error, PeerLost):
        sys.stdout.flush()
        end(EXIT_PEER_LOST)
    sys.exit(EXIT_USER_ERROR)
