"""The Slurm batch script ``invoke sbatch`` writes, as a pure function: the ``#SBATCH``
directives, the srun line from ``ddp_tasks.commands``, and what the script does with the job's
ending (tests/test_commands.py compares it with tests/golden/sbatch.sh).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ddp_tasks.commands import Launch, launch_segments, render
from launcher.env import parse_signal
from launcher.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, LaunchError

_DIRECTIVE_UNSAFE = re.compile(r"[\s'\"\\]")


@dataclass(frozen=True)
class Batch:
    """The ``#SBATCH`` settings that are not part of the srun line."""

    job_name: str = "ddp"
    time: str = "01:00:00"
    partition: str = ""
    account: str = ""
    signal: str = "USR1"
    signal_seconds: int = 60
    output: str = "%x-%j.out"
    #: more directives as sbatch options without "#SBATCH": "--mem=64G", "--qos=high"
    directives: tuple[str, ...] = ()
    #: shell lines run before srun, e.g. "module load openmpi/4.1"
    setup: tuple[str, ...] = ()


def batch_script(launch: Launch, batch: Batch) -> str:
    """The sbatch script: srun the program, and requeue the job when it exits preempted."""
    if launch.launcher != "srun":
        raise LaunchError("a batch script launches with srun", hint="build it with --launcher srun")
    if batch.signal_seconds < 1:
        raise LaunchError(
            f"--signal-seconds {batch.signal_seconds} leaves no time to save a checkpoint",
            hint="pass --signal-seconds 60 or more: time to finish a step and write a checkpoint",
        )
    directives = [
        f"--job-name={batch.job_name}",
        f"--nodes={launch.nodes}",
        f"--ntasks-per-node={launch.procs_per_node}",
    ]
    if launch.gpus_per_node:
        directives.append(f"--gpus-per-node={launch.gpus_per_node}")
    if launch.cpus_per_task:
        directives.append(f"--cpus-per-task={launch.cpus_per_task}")
    directives.append(f"--time={batch.time}")
    if batch.partition:
        directives.append(f"--partition={batch.partition}")
    if batch.account:
        directives.append(f"--account={batch.account}")
    directives += [_directive(item) for item in batch.directives]
    directives += [
        # no "B:": the signal goes to the ranks, which checkpoint and exit 75
        f"--signal={parse_signal(batch.signal, '--signal')}@{batch.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={batch.output}",
    ]
    for directive in directives:
        if _DIRECTIVE_UNSAFE.search(directive):
            raise LaunchError(
                f"#SBATCH {directive!r}: sbatch reads directives without shell quoting",
                hint="use a value without spaces, quotes or backslashes",
            )
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    setup = "".join(f"{line}\n" for line in batch.setup)
    return f"""#!/bin/bash
# Written by `invoke sbatch`; docs/launching.md explains each line.
{header}

{setup}{_status_file_lines(launch, render(launch_segments(launch)))}
# {EXIT_PREEMPTED}: the ranks caught the signal and saved a checkpoint. Requeue: the next run
# resumes from it. Exit with scontrol's status, so the job counts as failed only when the
# requeue itself failed.
if [ "$status" -eq {EXIT_PREEMPTED} ]; then
    echo "job $SLURM_JOB_ID preempted (exit {EXIT_PREEMPTED}): requeueing" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit $?
fi
# {EXIT_PEER_LOST}, a peer was lost: passed on, since requeueing without the lost node is
# not done yet; every other status is passed on too.
exit "$status"
"""


#: launcher.train's --run-dir default and the file launcher.exit_status writes there
TRAIN_RUN_DIR = "runs/train"
EXIT_STATUS_FILE = "exit-status"


def _status_file_lines(launch: Launch, step: str) -> str:
    """The step and ``status``: its own, or for launcher.train, when not 0, the one the ranks
    wrote to the run directory (torchrun exits 1 and srun 128 + N whatever the ranks knew)."""
    if launch.module != "launcher.train":
        return f"{step}\nstatus=$?"
    path = shlex.quote(f"{_flag_value(launch.args, '--run-dir') or TRAIN_RUN_DIR}/"
                       f"{EXIT_STATUS_FILE}")
    return f"""status_file={path}
rm -f "$status_file"  # a previous attempt's ending must not decide this one
{step}
status=$?
# A rank that knows how the job ended wrote it to the run directory: it decides, since
# torchrun exits 1 and srun 128 + N (a rank a signal ended) whatever the ranks knew.
if [ "$status" -ne 0 ] && [ -s "$status_file" ]; then
    read -r status reason < "$status_file"
    echo "job $SLURM_JOB_ID: the ranks report exit $status: $reason" >&2
fi"""


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The last value of ``flag`` in ``args`` (``FLAG VALUE`` or ``FLAG=VALUE``)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _directive(item: str) -> str:
    """``mem=64G`` or ``--mem=64G`` as the option sbatch reads."""
    item = item.strip()
    return item if item.startswith("-") else f"--{item}"


def submit_argv(script: str) -> list[str]:
    """``sbatch --parsable SCRIPT``: prints just the job id (``ID[;CLUSTER]``)."""
    return ["sbatch", "--parsable", script]
