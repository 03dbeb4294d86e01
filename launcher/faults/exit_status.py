"""How the job ended, in a file of the run directory: what a batch script reads under any launcher.

torchrun exits 1 whenever a rank exits non-zero, so its status cannot tell "preempted, requeue
me" (75) from "a peer was lost" (3) or a crash; srun reports 128 + N for a rank a signal ended.
So the ranks that know write ``<run-dir>/exit-status``, one line: the status and why
(``75 preempted, runs/train/checkpoints/ckpt-00000120.pt saved``). The batch script of
``invoke sbatch`` removes it before the step and, when the step's status is not 0, takes the
file's: one rule for srun, mpiexec and torchrun.

Written only for the endings this package decides, atomically (``launcher.core.atomic``): an ending
every rank agreed on (75, 130, a user error raised everywhere) by rank 0 alone, a lost peer (3)
by every survivor (any of them may be the lost one's only witness), a rank's failure (70, 2)
by the ranks that report it, a hang (4) by rank 0, which decided it. A rank that is killed
writes nothing: the launcher's status stands.

A lost peer's node names (as Slurm knows them) go to ``<run-dir>/lost-nodes``, one per line,
written before ``exit-status`` so that a script that finds the status finds the names too: the
batch script excludes those nodes from the requeued job. A survivor that could not name them
(the rendezvous store went with the lost node) leaves another survivor's file alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from launcher.core.atomic import write_atomic
from launcher.core.errors import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_PEER_LOST,
    EXIT_USER_ERROR,
    LaunchError,
    PeerLost,
    Preempted,
    RankFailed,
    raised_everywhere,
)
from launcher.core.run_files import EXIT_STATUS_FILE, LOST_NODES_FILE


@contextmanager
def recorded(run_dir: Path, rank: int) -> Iterator[None]:
    """Write ``run_dir/exit-status`` when the body ends the job with one of this package's
    statuses (the exception then goes on to ``launcher.faults.exits.exit_statuses``)."""
    try:
        yield
    except Preempted as stopped:
        if rank == 0:
            what = "interrupted" if stopped.status == EXIT_INTERRUPTED else "preempted"
            _write(run_dir, stopped.status, f"{what}, {stopped.checkpoint} saved")
        raise
    except PeerLost as lost:
        record_lost(run_dir, lost)
        raise
    except LaunchError as error:
        if not raised_everywhere(error) or rank == 0:
            _write(run_dir, EXIT_USER_ERROR, error.message)
        raise
    except RankFailed as failed:
        # a survivor that saw the failure before its watchdog ended it raises this too
        _write(run_dir, failed.status, "a rank failed: the job's log names it")
        raise


def record_lost(run_dir: Path, lost: PeerLost) -> None:
    """A peer was lost: written by every survivor, with the nodes it found silent."""
    # ``nodes``: which nodes the survivors found silent (empty when nobody could tell)
    nodes = getattr(lost, "nodes", ())
    if nodes:
        with suppress(OSError):
            write_atomic(run_dir / LOST_NODES_FILE, "".join(f"{n}\n" for n in nodes).encode())
    _write(run_dir, EXIT_PEER_LOST, lost.message)


def record_hang(run_dir: Path, line: str) -> None:
    """The ranks do not meet (``launcher.faults.hang_watch``): written by rank 0, which decided."""
    _write(run_dir, EXIT_HUNG, line)


def _write(run_dir: Path, status: int, reason: str) -> None:
    line = " ".join(f"{status} {reason}".split())  # one line, whatever the message held
    # the run directory may be the problem being reported, or gone: the log says so
    with suppress(OSError):
        write_atomic(run_dir / EXIT_STATUS_FILE, f"{line}\n".encode())
