"""Developer tasks: run the local default job, the self-check, the tests and the linters."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from invoke import task

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def local_mpi_command(ranks: int, module: str, args: str = "") -> list[str]:
    """``mpiexec -n RANKS python -m MODULE ARGS`` with the venv's MPICH, for one machine."""
    return [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", module,
            *shlex.split(args)]


@task(help={"ranks": "ranks on this machine (default 2)", "args": "extra launcher.train flags"})
def train(c, ranks=2, args=""):
    """Train the default model on this machine with RANKS MPI ranks (no cluster needed)."""
    c.run(shlex.join(local_mpi_command(ranks, "launcher.train", args)), pty=False)


@task(help={"ranks": "ranks on this machine (default 2)", "args": "extra launcher.check flags"})
def check(c, ranks=2, args=""):
    """Run the cluster self-check on this machine with RANKS MPI ranks."""
    c.run(shlex.join(local_mpi_command(ranks, "launcher.check", args)), pty=False)


@task(help={"args": "extra pytest arguments, e.g. '-m \"not docker\"' or '-k hostlist'"})
def test(c, args=""):
    """Run the whole test suite (starts the daemons it needs: dockerd, munge, Slurm, registry)."""
    c.run(f"{shlex.quote(sys.executable)} -m pytest {args}", pty=False)


@task
def lint(c):
    """ruff on the Python code, shellcheck on the scripts, hadolint on the Dockerfile."""
    c.run(f"{BIN / 'ruff'} check {ROOT}", pty=False)
    shell = [*ROOT.glob("scripts/*.sh"), *ROOT.glob("docker/**/*.sh"), ROOT / ".ci/run"]
    scripts = " ".join(str(p) for p in sorted(shell) if p.exists())
    if scripts:
        c.run(f"shellcheck {scripts}", pty=False)
    dockerfile = ROOT / "docker" / "Dockerfile"
    if dockerfile.exists():
        c.run(f"{BIN / 'hadolint'} {dockerfile}", pty=False)


TASKS = [train, check, test, lint]
