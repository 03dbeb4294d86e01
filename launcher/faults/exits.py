"""How a rank's process ends: the documented exit status, and one line on stderr, for what this
package raises (``exit_statuses``). Used around every entry point and by ``launcher.distributed``;
the public API offers it as ``launcher.exit_statuses``."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from launcher.core.errors import (
    EXIT_INTERRUPTED,
    LaunchError,
    PeerLost,
    Preempted,
    RankFailed,
    report_and_exit,
)
from launcher.faults import exit_status
from launcher.placement.env import JobEnv, detect_environment

#: seconds a survivor of a lost peer waits between its line and MPI_Abort: Hydra ends the job at
#: the first abort, and forwards only what it has read by then (16 ranks, a script that prints
#: and aborts: 5 of 15 survivors' lines arrived with no wait, all 15 after 0.5 s)
FORWARD_S = 1.0
#: where MPICH's Hydra proxy writes the node's topology for its ranks (a fixed path in its code)
HYDRA_TOPOLOGY = "/tmp/hydra_hwloc_xmlfile_"


def end_process(status: int, linger_s: float = 0.0) -> None:
    """End this process with ``status`` now: ``MPI_Abort`` when MPI runs (the launcher then
    ends every rank), after ``linger_s`` for the launcher to forward what was just printed;
    else ``os._exit`` (no teardown that could wait for a failed peer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        time.sleep(linger_s)
        abort_mpi(mpi, status)
    os._exit(status)


def abort_mpi(mpi, status: int) -> None:
    """``MPI_Abort`` (``mpi``: the mpi4py.MPI module), the only way this project calls it:
    Hydra's topology file removed first (``remove_hydra_topology``)."""
    remove_hydra_topology()
    mpi.COMM_WORLD.Abort(status)


def remove_hydra_topology(ancestors: int = 3) -> list[str]:
    """Remove the node's topology file that Hydra's proxy (this rank's parent, or an ancestor
    under a container runtime) holds open: it writes ``/tmp/hydra_hwloc_xmlfile_*`` for its
    ranks and removes it when it ends, but MPI_Abort kills it first, which left one file per
    node of every failed job. Its ranks read it in MPI_Init, done by now. Not inside a user
    namespace of the rank's own (ch-run, rootless Apptainer): the kernel refuses to show it
    the proxy's open files. What was removed."""
    removed, pid = [], os.getpid()
    for _ in range(ancestors):
        pid = _parent(pid)
        if pid <= 1:
            break
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(HYDRA_TOPOLOGY):
                with suppress(OSError):
                    os.unlink(target)
                    removed.append(target)
    return removed


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # "pid (comm) state ppid ...": comm may hold ")"
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _peer_lost_end(env: JobEnv | None) -> Callable[[int], None]:
    """How a survivor of a lost peer ends. MPI_Abort where the launcher's own status is what
    the user reads (Hydra, mpirun: else it reports the signal of the ranks it kills, 9, not 3);
    not under srun, where the batch script reads the run directory's exit-status, and an abort
    through PMI-2 after a peer died went with crashes and a requeued job failing in MPI_Init."""
    if env is not None and env.launcher == "slurm":
        return os._exit
    return lambda status: end_process(status, linger_s=FORWARD_S)


def lost_peer_ending(env: JobEnv, run_dir: Path | None) -> Callable[[PeerLost], None]:
    """How a thread ends this rank for a lost peer that no call of the main thread raises
    (``launcher.faults.gpu_waits``): as ``exit_statuses`` and ``exit_status.recorded`` would."""
    def end(lost: PeerLost) -> None:
        if run_dir is not None:
            exit_status.record_lost(run_dir, lost)
        report_and_exit(lost, env.rank, end=_peer_lost_end(env))
    return end


@contextmanager
def exit_statuses(env: JobEnv | None = None) -> Iterator[JobEnv]:
    """End the process with the documented exit status when the body raises what this
    package raises: 2 a user error, 3 a lost peer, 70 a rank that raised, 75 preempted, 130
    interrupted. Yields this process's ``JobEnv``: ``env`` when the caller has it, else read
    here, as the entry points' first step, and handed on from there (``distributed(env=...)``)."""
    rank = None if env is None else env.rank
    try:
        if env is None:
            # the one step that reads the environment, so its own errors end here too
            env = detect_environment()
            rank = env.rank
        yield env
    except LaunchError as error:
        report_and_exit(error, rank, end=_peer_lost_end(env))
    except Preempted as preempted:
        # every rank says so: under mpiexec/srun only one exit status reaches the job log
        what = "interrupted" if preempted.status == EXIT_INTERRUPTED else "preempted"
        saved = f", {preempted.checkpoint} saved" if preempted.checkpoint else ""
        print(f"[rank {rank}] {what}{saved}: exit {preempted.status}",
              file=sys.stderr, flush=True)
        sys.exit(preempted.status)
    except RankFailed as failed:  # reported here and to every other rank already
        end_process(failed.status)
