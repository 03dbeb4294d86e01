"""The Slurm batch script ``invoke sbatch`` writes, as a pure function: the ``#SBATCH``
directives, the srun line from ``ddp_tasks.commands``, and what the script does with the job's
ending (tests/test_commands.py compares it with tests/golden/sbatch.sh; docs/launching.md
explains the exit codes). The shell that decides is ``ddp_tasks.batch_endings``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ddp_tasks import sweep as sweeps
from ddp_tasks.batch_endings import (
    JOB,
    SLOW_NODES,
    TRAIN_RUN_DIR,
    plain_ending,
    preflight_lines,
    train_ending,
    train_prologue,
)
from ddp_tasks.commands import launch_segments, render
from ddp_tasks.launch_spec import Launch
from ddp_tasks.sweep import Sweep
from launcher.core.defaults import PREEMPT_SIGNAL
from launcher.core.errors import LaunchError
from launcher.core.run_files import EXIT_STATUS_FILE
from launcher.placement.env import parse_signal

__all__ = ["EXIT_STATUS_FILE", "TRAIN_RUN_DIR", "Batch", "batch_script", "node_range",
           "submit_argv", "time_limit_seconds"]

_DIRECTIVE_UNSAFE = re.compile(r"[\s'\"\\]")
#: the srun step's node count inside a range allocation: what the job was given this time
_ALLOCATED_NODES = '"$SLURM_JOB_NUM_NODES"'
#: Slurm's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
_TIME = re.compile(r"(?:(\d+)-)?(\d+(?::\d+){0,2})?")
_NO_LIMIT = {"-1", "INFINITE", "UNLIMITED"}
#: Slurm may send --signal this many seconds earlier than asked (sbatch(1), --signal)
_SIGNAL_EARLY = 60


@dataclass(frozen=True)
class Batch:
    """The ``#SBATCH`` settings that are not part of the srun line."""

    #: Slurm job name
    job_name: str = "ddp"
    #: Slurm time limit (minutes, HH:MM:SS, D-HH:MM...); empty: the partition's default
    time: str = "01:00:00"
    #: Slurm partition (default: the cluster's)
    partition: str = ""
    #: Slurm account (default: yours)
    account: str = ""
    #: the preemption signal sbatch sends the ranks (a name without "SIG")
    signal: str = PREEMPT_SIGNAL
    #: send the preemption signal this many seconds before the limit
    signal_seconds: int = 60
    #: Slurm output file (%x: job name, %j: job id); appended to on requeue (default %x-%j.out;
    #: a sweep's: %x-%A_%a.out, %A the array job, %a the task)
    output: str = "%x-%j.out"
    #: more directives as sbatch options without "#SBATCH": "--mem=64G", "--qos=high"
    directives: tuple[str, ...] = ()
    #: shell lines run before srun, e.g. "module load openmpi/4.1"
    setup: tuple[str, ...] = ()
    #: requeues after a lost node (exit 3) or a preflight's slow nodes, per job; preemptions
    #: (75) are not counted: they are the scheduler's doing and each one saved a checkpoint
    max_restarts: int = 3
    #: the most nodes the job may run on: ``--nodes=NODES-MAX_NODES``, so that a requeue
    #: without a lost node can start on fewer; 0: exactly the launch's nodes
    max_nodes: int = 0
    #: run ``launcher.check --preflight`` on the allocation first; requeue without the nodes
    #: it names
    preflight: bool = False


def batch_script(launch: Launch, batch: Batch, sweep: Sweep | None = None) -> str:
    """The sbatch script: srun the program, requeue the job when it was preempted, and when a
    node was lost requeue it without that node. With a ``sweep``, an array job: each task
    trains one configuration in its own run directory and is requeued alone."""
    _check(launch, batch, sweep)
    header = "\n".join(f"#SBATCH {d}" for d in _directives(launch, batch, sweep))
    setup = "".join(f"{line}\n" for line in batch.setup)
    ranged = batch.max_nodes > launch.nodes
    if sweep:
        launch = replace(launch, args=(*launch.args, sweeps.ARGS_TOKEN))
    step = _step(launch, ranged)
    if not _trains(launch):
        body = f"{step}\nstatus=$?\n{plain_ending()}"
    else:
        run_dir = _flag_value(launch.args, "--run-dir") or TRAIN_RUN_DIR
        preflight = ""
        if batch.preflight:
            check = replace(launch, module="launcher.check",
                            args=("--preflight", "--slow-nodes", "__SLOW_NODES__"))
            preflight = preflight_lines(_step(check, ranged).replace("__SLOW_NODES__", SLOW_NODES))
        task = ""
        if sweep:
            task = sweeps.task_lines(sweep, run_dir)
            step = _replace_once(step, sweeps.ARGS_TOKEN, sweeps.TASK_ARGS)
        body = (task + train_prologue(run_dir, batch.max_restarts, task=bool(sweep)) + preflight
                + f"{step}\nstatus=$?\n" + train_ending("$job" if sweep else JOB))
    return f"""#!/bin/bash
# Written by `invoke sbatch`; docs/launching.md explains each line.
{header}

{setup}{body}"""


def node_range(text: str) -> tuple[int, int]:
    """``--nodes`` of ``invoke sbatch``: ``"2"`` is ``(2, 0)``, ``"2-3"`` is ``(2, 3)``: the
    launch's nodes and ``Batch.max_nodes``."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(text))
    if not match:
        raise LaunchError(f"--nodes {text!r} is neither a count nor a range",
                          hint="pass a count (--nodes 2) or a range (--nodes 2-3)")
    return int(match[1]), int(match[2] or 0)


def time_limit_seconds(text: str) -> int | None:
    """``--time`` as Slurm reads it (parse_time.c), in seconds rounded up to whole minutes as
    Slurm keeps it; None for no limit (UNLIMITED, 0) or none given (the partition's)."""
    text = text.strip()
    if not text or text.upper() in _NO_LIMIT:
        return None
    match = _TIME.fullmatch(text)
    if not match:
        raise LaunchError(f"--time {text!r} is not a Slurm time limit",
                          hint="pass minutes (90), HH:MM:SS (01:30:00) or D-HH:MM:SS (1-12:00:00)")
    days, clock = match.groups()
    fields = [int(field) for field in clock.split(":")] if clock else []
    if days is not None:
        hours, minutes, seconds = (*fields, 0, 0, 0)[:3]
    else:  # one field is minutes, two minutes:seconds, three hours:minutes:seconds
        hours, minutes, seconds = fields if len(fields) == 3 else (0, *fields, 0)[:3]
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return -(-total // 60) * 60 or None  # a limit of 0 is Slurm's "no limit"


def _check(launch: Launch, batch: Batch, sweep: Sweep | None) -> None:
    if launch.launcher != "srun":
        raise LaunchError("a batch script launches with srun", hint="build it with --launcher srun")
    if batch.signal_seconds < 1:
        raise LaunchError(
            f"--signal-seconds {batch.signal_seconds} leaves no time to save a checkpoint",
            hint="pass --signal-seconds 60 or more: time to finish a step and write a checkpoint",
        )
    limit = time_limit_seconds(batch.time)
    if limit is not None and batch.signal_seconds + _SIGNAL_EARLY >= limit:
        minutes = (batch.signal_seconds + _SIGNAL_EARLY) // 60 + 1
        shorter = (f", or --signal-seconds below {limit - _SIGNAL_EARLY}"
                   if limit - _SIGNAL_EARLY > 1 else "")
        raise LaunchError(
            f"--signal-seconds {batch.signal_seconds} with --time {batch.time}: Slurm may send "
            f"the signal up to {_SIGNAL_EARLY} s early, so it can come at the job's start: the "
            "job would save nothing, exit 75 and be requeued again and again",
            hint=f"pass a --time of {minutes} minutes or more for --signal-seconds "
            f"{batch.signal_seconds}{shorter}",
        )
    if batch.max_restarts < 0:
        raise LaunchError(f"--max-restarts {batch.max_restarts} is negative",
                          hint="pass 0 (never requeue after a lost node) or more")
    if batch.max_nodes and batch.max_nodes < launch.nodes:
        raise LaunchError(f"--nodes {launch.nodes}-{batch.max_nodes}: the range is empty",
                          hint=f"pass a maximum of {launch.nodes} or more, e.g. "
                          f"--nodes {launch.nodes}-{launch.nodes + 1}")
    if batch.preflight and not _trains(launch):
        raise LaunchError(f"--preflight runs before launcher.train, not --module {launch.module}",
                          hint="leave --preflight out, or run launcher.train")
    if sweep and not _trains(launch):
        raise LaunchError(f"--sweep sets flags of launcher.train, not --module {launch.module}",
                          hint="leave --sweep out, or run launcher.train")


def _directives(launch: Launch, batch: Batch, sweep: Sweep | None) -> list[str]:
    directives = [f"--job-name={batch.job_name}"]
    if sweep:
        directives.append(f"--array={sweep.array()}")
    if batch.max_nodes > launch.nodes:
        # with --ntasks-per-node Slurm counts the tasks from the minimum and starts on the
        # fewest nodes; with the CPUs per node instead it takes as many as it can (22.05)
        cpus = launch.procs_per_node * max(launch.cpus_per_task, 1)
        directives += [f"--nodes={launch.nodes}-{batch.max_nodes}", f"--mincpus={cpus}"]
    else:
        directives += [f"--nodes={launch.nodes}", f"--ntasks-per-node={launch.procs_per_node}"]
    if launch.gpus_per_node:
        directives.append(f"--gpus-per-node={launch.gpus_per_node}")
    if launch.cpus_per_task:
        directives.append(f"--cpus-per-task={launch.cpus_per_task}")
    if batch.time.strip():
        directives.append(f"--time={batch.time.strip()}")
    if batch.partition:
        directives.append(f"--partition={batch.partition}")
    if batch.account:
        directives.append(f"--account={batch.account}")
    directives += [_directive(item) for item in batch.directives]
    output = batch.output
    if sweep and output == Batch.output:
        output = sweeps.TASK_OUTPUT  # each task its own file
    directives += [
        # no "B:": the signal goes to the ranks, which checkpoint and exit 75
        f"--signal={parse_signal(batch.signal, '--signal')}@{batch.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={output}",
    ]
    for directive in directives:
        if _DIRECTIVE_UNSAFE.search(directive):
            raise LaunchError(
                f"#SBATCH {directive!r}: sbatch reads directives without shell quoting",
                hint="use a value without spaces, quotes or backslashes",
            )
    return directives


def _step(launch: Launch, ranged: bool) -> str:
    """The srun line; in a range allocation it spans the nodes this attempt was given."""
    line = render(launch_segments(launch))
    if not ranged:
        return line
    return _replace_once(line, f"srun --nodes {launch.nodes} ", f"srun --nodes {_ALLOCATED_NODES} ")


def _replace_once(line: str, old: str, new: str) -> str:
    """``old`` in the rendered step replaced; a launcher or runtime that no longer renders it
    as one plain word fails loudly rather than writing a script that does something else."""
    if line.count(old) != 1:
        raise LaunchError(f"cannot find {old.strip()!r} once in the step {line!r}",
                          hint="leave the node range or the sweep out, and report this")
    return line.replace(old, new)


def _trains(launch: Launch) -> bool:
    """Whether the step runs launcher.train: itself, or under torchrun (``-m launcher.train``),
    the ranks then write how the job ended to the run directory."""
    return launch.module == "launcher.train" or "launcher.train" in launch.args


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
