"""Pure builders of the launch command lines (the batch script around them: batch_script.py).

Nothing here starts a process or reads the environment: each function maps its arguments to an
argv list or to text, so tests/test_commands.py compares the results with golden files.

The launch's runtime and host launcher (runtimes.py, host_launchers.py) make the parts; this
module checks what is common to all of them and puts the parts together. A command is kept as
*segments* (where the launcher runs, launcher, environment, container, program) so that it
prints one segment per line, joined by backslash-newlines: the printed text is exactly what
``invoke run`` hands to the shell, and it can be pasted as it is.
"""

from __future__ import annotations

import re
import shlex

from ddp_tasks.host_launchers import HostLauncher, Srun, host_launcher
from ddp_tasks.launch_spec import Launch, choose
from ddp_tasks.runtimes import RUNTIMES, Runtime, ShellText
from launcher.core.errors import LaunchError
from launcher.placement.env import parse_signal

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SEGMENT_JOIN = " \\\n    "


def parse_env(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``["K=V", ...]`` from repeated ``--env K=V`` flags as (name, value) pairs."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise LaunchError(
                f"--env {item!r} is not NAME=VALUE",
                hint="give one variable per flag: --env DDP_DATA=/scratch/data --env FOO=1",
            )
        pairs.append((name, value))
    return tuple(pairs)


def program_env(
    signal_name: str,
    omp_threads: int = 0,
    master_addr: str = "",
    master_port: int = 0,
    ifname: str = "",
    extra: tuple[tuple[str, str], ...] = (),
) -> tuple[tuple[str, str], ...]:
    """The variables every rank's program needs, in a fixed order; ``extra`` wins on a clash.

    Rank, size and the rendezvous address are not here: launcher.env reads them from the
    launcher's own variables. MASTER_ADDR/MASTER_PORT and the interface are passed only when
    given, because the right values depend on the site. A DDP_PREEMPT_SIGNAL in ``extra``
    must name the signal itself: ``invoke sbatch`` writes ``signal_name`` into ``#SBATCH
    --signal``, and a signal the ranks do not catch ends them without a checkpoint.
    """
    signal = parse_signal(signal_name, "--signal")
    given = dict(extra).get("DDP_PREEMPT_SIGNAL", signal)
    if parse_signal(given, "--env DDP_PREEMPT_SIGNAL") != signal:
        raise LaunchError(
            f"--env DDP_PREEMPT_SIGNAL={given} differs from the preemption signal {signal} "
            "(--signal, or its default)",
            hint=f"drop it from --env and pass --signal {given}: it sets DDP_PREEMPT_SIGNAL "
            "and sbatch's --signal together",
        )
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(omp_threads or 1),
        "DDP_PREEMPT_SIGNAL": signal,
    }
    if master_addr:
        env["MASTER_ADDR"] = master_addr
    if master_port:
        env["MASTER_PORT"] = str(master_port)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
    env.update(extra)
    return tuple(env.items())


def with_resume(module: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """``--resume auto`` first for launcher.train, so a requeued job continues, unless given."""
    if module != "launcher.train" or any(a.split("=")[0] == "--resume" for a in args):
        return args
    return ("--resume", "auto", *args)


def runtime_of(launch: Launch) -> Runtime:
    """The launch's container runtime; raises LaunchError for an unknown one."""
    choose("--runtime", launch.runtime, tuple(RUNTIMES))
    return RUNTIMES[launch.runtime]()


def validate(launch: Launch, runtime: Runtime, launcher: HostLauncher) -> None:
    """Raise LaunchError for a launch that cannot work, naming the flag to change. The rules of
    one runtime or host launcher are its own ``validate``; here is what holds for all."""
    # every launch, not only srun's: a mistyped --pmi is caught before the job moves to Slurm
    choose("--pmi", launch.pmi, Srun.PMIS)
    for flag, value in (("--nodes", launch.nodes), ("--procs-per-node", launch.procs_per_node)):
        if value < 1:
            raise LaunchError(f"{flag} {value} must be at least 1", hint=f"pass {flag} 1 or more")
    for flag, value in (("--gpus-per-node", launch.gpus_per_node),
                        ("--cpus-per-task", launch.cpus_per_task)):
        if value < 0:
            raise LaunchError(f"{flag} {value} is negative", hint=f"leave {flag} out or pass 1+")
    if launch.hosts and launch.hostfile:
        raise LaunchError("both --hosts and --hostfile given", hint="pass only one of them")
    if launch.hosts and len(launch.hosts) != launch.nodes:
        raise LaunchError(
            f"--hosts names {len(launch.hosts)} host(s) but --nodes is {launch.nodes}",
            hint=f"name one host per node, or pass --nodes {len(launch.hosts)}",
        )
    runtime.validate(launch)
    launcher.validate(launch, runtime)


def program_argv(launch: Launch) -> list[str]:
    """``python -m MODULE ARGS``: ``python`` is the image's venv (or the host's) on PATH."""
    return ["python", "-m", launch.module, *launch.args]


def container_argv(launch: Launch) -> list[str]:
    """The hybrid model: the host's launcher starts the runtime once per rank."""
    return runtime_of(launch).exec_prefix(launch)


def launch_segments(launch: Launch) -> list[list[str]]:
    """The whole command as non-empty segments; raises LaunchError for a bad ``launch``."""
    launcher, runtime = host_launcher(launch), runtime_of(launch)
    launch = runtime.prepare(launch)
    validate(launch, runtime, launcher)
    segments = [
        runtime.outer(launch),
        launcher.argv(launch, runtime),
        launcher.env_args(runtime.launcher_env(list(launch.env))),
        runtime.exec_prefix(launch),
        program_argv(launch),
    ]
    return [segment for segment in segments if segment]


def render(segments: list[list[str]]) -> str:
    """Shell text of a command, one segment per line; a ``ShellText`` word stays unquoted."""
    return _SEGMENT_JOIN.join(
        " ".join(word if isinstance(word, ShellText) else shlex.quote(word) for word in segment)
        for segment in segments)
