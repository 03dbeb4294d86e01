"""The benchmark scripts that run on ranks: how a job of them starts on this machine, how it
reports back, and how they get to a compose cluster (the image holds launcher/ but not
benchmarks/, so node0 gets them on the volume every node shares, laid out as in the checkout:
they import their helpers as ``benchmarks.*``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: what the rank-side jobs import or run
SCRIPTS = ("allreduce.py", "floor.py", "timing.py", "tuning.py", "units.py", "rank_side.py")
#: where every node finds them
SHARED = "/shared/benchmarks"
#: the line that starts a rank-side job's one-line JSON result
RESULT = "RESULT "


def local_mpiexec(ranks: int) -> list[str]:
    """The venv's mpiexec starting RANKS ranks on this machine."""
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks)]


def report(result: dict) -> None:
    """Print RESULT as a job's result line (rank 0 only)."""
    print(RESULT + json.dumps(result), flush=True)


def result_of(stdout: str) -> dict[int, float]:
    """The result line of a job's output, keyed by message size."""
    line = next(x for x in stdout.splitlines() if x.startswith(RESULT))
    return {int(k): v for k, v in json.loads(line.removeprefix(RESULT)).items()}


def copy_to(node0: str) -> str:
    """Copy SCRIPTS into container NODE0's shared volume; their directory there."""
    subprocess.run(["docker", "exec", node0, "mkdir", "-p", SHARED], check=True, timeout=60)
    for name in SCRIPTS:
        subprocess.run(["docker", "cp", str(HERE / name), f"{node0}:{SHARED}/{name}"],
                       check=True, timeout=60)
    return SHARED
