"""Developer tasks: run the local default job, the self-check, the tests and the linters."""

from __future__ import annotations

import os
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


def test_workers() -> int:
    """pytest-xdist workers for `invoke test`: two per core, at least four. Most of the suite's
    time is waiting (image builds, daemons, timeouts), so even 2 cores keep 4 workers busy."""
    return max(4, 2 * (os.cpu_count() or 1))


def pytest_command(args: str = "", workers: int | None = None) -> list[str]:
    """The suite on WORKERS workers, tests that share a service kept on one
    (tests/fixtures/scheduling.py); 0 workers: in this process, as plain pytest."""
    workers = test_workers() if workers is None else workers
    # the groups in tests/fixtures/scheduling.py's order, not the largest first
    spread = ["-n", str(workers), "--dist", "loadgroup", "--no-loadscope-reorder"] \
        if workers else []
    # every run leaves its figures, so that two runs' drift can be compared test by test
    timing = ["--timing-json", str(ROOT / "runs" / "test-timing.json")]
    return [sys.executable, "-m", "pytest", *spread, *timing, *shlex.split(args)]


@task(help={"args": "extra pytest arguments, e.g. '-m \"not docker\"' or '-k hostlist'",
            "workers": f"parallel pytest workers (default {test_workers()} here: two per core, "
                       "at least four); 0 runs the tests in one process"})
def test(c, args="", workers=None):
    """Run the whole test suite (starts the daemons it needs: dockerd, munge, Slurm, registry)."""
    c.run(shlex.join(pytest_command(args, None if workers is None else int(workers))),
          pty=False)


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
