"""A sweep: one Slurm array job over a grid of launcher.train flags, as pure values and text.

``invoke sbatch --sweep lr=0.1,0.05 --sweep global-batch-size=64,128`` is four configurations,
one array task each (``#SBATCH --array=0-3``). Each task finds its flags and its run directory
by ``$SLURM_ARRAY_TASK_ID`` in a ``case`` the batch script carries, so the script is one file
that reads nothing at run time; the run directory is ``RUN_ROOT/NAME=VALUE,NAME=VALUE``, which
``invoke sweep-summary RUN_ROOT`` and ``invoke plot`` read back. Everything else of the script
(preemption, lost nodes) is the single job's, for the task alone: an array task's requeue names
``JOBID_TASKID``, since ``scontrol requeue`` of the array's own id would requeue every task.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from launcher.core.errors import LaunchError

#: a flag of launcher.train without its dashes, and a value that is safe in a directory name
_NAME = re.compile(r"[a-z][a-z0-9-]*\Z")
_VALUE = re.compile(r"[A-Za-z0-9._+-]+\Z")
#: where the task's flags go in the srun line (replaced in the rendered script)
ARGS_TOKEN = "__SWEEP_ARGS__"
#: what replaces it: the task's flags and its run directory, last, so that they win
TASK_ARGS = '"${sweep_args[@]}" --run-dir "$run_dir"'
#: the task's own job in scontrol's words, and the default output file of an array task
TASK_JOB = "${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
TASK_OUTPUT = "%x-%A_%a.out"


@dataclass(frozen=True)
class Sweep:
    """A grid of launcher.train flags: every combination of the values is one array task."""

    #: the flags swept, in order, each with its values: (("lr", ("0.1", "0.05")), ...)
    axes: tuple[tuple[str, tuple[str, ...]], ...]
    #: at most this many tasks run at once (``--array=0-N%THROTTLE``); 0: as many as fit
    throttle: int = 0

    def configs(self) -> list[tuple[tuple[str, str], ...]]:
        """Every combination, the first axis slowest: ``((("lr", "0.1"), ("seed", "0")), ...)``."""
        names = [name for name, _ in self.axes]
        return [tuple(zip(names, values, strict=True))
                for values in itertools.product(*(values for _, values in self.axes))]

    def array(self) -> str:
        """sbatch's ``--array`` value."""
        last = len(self.configs()) - 1
        return f"0-{last}" + (f"%{self.throttle}" if self.throttle else "")


def config_name(config: Iterable[tuple[str, str]]) -> str:
    """A configuration's run directory name: ``lr=0.1,global-batch-size=64``."""
    return ",".join(f"{name}={value}" for name, value in config)


def parse_config_name(name: str) -> tuple[tuple[str, str], ...] | None:
    """``config_name``'s inverse; None for a name no sweep writes."""
    pairs = [part.partition("=") for part in name.split(",")]
    if not all(sep and _NAME.match(key) and _VALUE.match(value) for key, sep, value in pairs):
        return None
    return tuple((key, value) for key, _, value in pairs)


def parse_sweep(specs: Iterable[str], file_text: str = "", throttle: int = 0) -> Sweep:
    """``--sweep NAME=V1,V2`` flags, then the lines of a ``--sweep-file`` (the same form, ``#``
    comments), as a Sweep; a LaunchError names the first bad one."""
    lines = [line.split("#", 1)[0].strip() for line in file_text.splitlines()]
    axes: dict[str, tuple[str, ...]] = {}
    for spec in [*specs, *(line for line in lines if line)]:
        name, sep, text = spec.partition("=")
        name = name.strip().removeprefix("--")
        values = tuple(value.strip() for value in text.split(","))
        if not sep or not _NAME.match(name) or not all(_VALUE.match(v) for v in values):
            raise LaunchError(f"--sweep {spec!r} is not FLAG=VALUE,VALUE,...",
                              hint="name a launcher.train flag without dashes and values made of "
                              "letters, digits and ._+-: --sweep lr=0.1,0.05")
        if name in axes or name in ("run-dir", "resume"):
            raise LaunchError(f"--sweep {name} is given twice" if name in axes else
                              f"--sweep {name}: each task sets its own --{name}",
                              hint="sweep each flag once, with all its values in one list")
        if len(set(values)) != len(values):
            raise LaunchError(f"--sweep {spec!r} repeats a value",
                              hint="list each value once: each is one run directory")
        axes[name] = values
    if not axes:
        raise LaunchError("the sweep is empty", hint="pass --sweep lr=0.1,0.05 or a --sweep-file")
    if throttle < 0:
        raise LaunchError(f"--throttle {throttle} is negative",
                          hint="pass 0 (no limit) or the most tasks to run at once")
    return Sweep(tuple(axes.items()), throttle)


def task_lines(sweep: Sweep, root: str) -> str:
    """The script's lines that pick this task's flags and run directory under ``root``."""
    configs = sweep.configs()
    cases = "".join(
        f"    {i}) config={shlex.quote(config_name(config))}; "
        f"sweep_args=({' '.join(f'--{name} {value}' for name, value in config)}) ;;\n"
        for i, config in enumerate(configs))
    return f"""\
# This array task's configuration: its flags (after the others, so they win) and its run
# directory. Its requeues name it alone: {TASK_JOB}.
case ${{SLURM_ARRAY_TASK_ID:?submit this script with sbatch: it is an array job}} in
{cases}    *) echo "array task $SLURM_ARRAY_TASK_ID is not one of the sweep's {len(configs)}" >&2
       exit 2 ;;
esac
job={TASK_JOB}
"""
