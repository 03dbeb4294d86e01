"""How a rank's process ends: the documented exit status, and one line on stderr, for what this
package raises (``exit_statuses``). Used around every entry point and by ``launcher.distributed``;
the public API offers it as ``launcher.exit_statuses``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from launcher.core.errors import EXIT_INTERRUPTED, LaunchError, RankFailed, report_and_exit
from launcher.faults.failfast import end_process
from launcher.faults.preemption import Preempted
from launcher.placement.env import JobEnv, detect_environment


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
        report_and_exit(error, rank)
    except Preempted as preempted:
        # every rank says so: under mpiexec/srun only one exit status reaches the job log
        what = "interrupted" if preempted.status == EXIT_INTERRUPTED else "preempted"
        saved = f", {preempted.checkpoint} saved" if preempted.checkpoint else ""
        print(f"[rank {rank}] {what}{saved}: exit {preempted.status}",
              file=sys.stderr, flush=True)
        sys.exit(preempted.status)
    except RankFailed as failed:  # reported here and to every other rank already
        end_process(failed.status)
