"""``Launch``: what one launch is, as a value. A leaf: the builders (commands.py), the runtimes
(runtimes.py), the host launchers and the tasks all import it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import LaunchError


@dataclass(frozen=True)
class Launch:
    """One launch: NODES x PROCS_PER_NODE ranks of ``python -m MODULE ARGS``.

    ``env`` holds the program's variables in order (see ``commands.program_env``); ``hosts`` is
    empty when the launcher finds the nodes itself (srun, or one node with mpirun).
    """

    nodes: int = 1
    procs_per_node: int = 1
    launcher: str = "mpirun"
    mpi: str = "mpich"
    runtime: str = "apptainer"
    pmi: str = "pmi2"
    hosts: tuple[str, ...] = ()
    hostfile: str = ""
    image: str = ""  # empty: the runtime's default (ddp-cpu.sif, ddp-cpu, ...)
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    binds: tuple[str, ...] = ()
    module: str = "launcher.train"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    container_prefix: str = ""  # docker: container names are PREFIX + host (cluster.up --prefix)


def choose(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise LaunchError unless ``value`` (given as ``flag``) is one of ``choices``."""
    if value not in choices:
        raise LaunchError(f"unknown {flag} {value!r}", hint=f"choose one of: {', '.join(choices)}")
