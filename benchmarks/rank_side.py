"""The benchmark scripts that run on ranks: how a job of them starts on this machine, how it
reports back, and how they get to a compose cluster (the image holds launcher/ but not
benchmarks/, so node0 gets them on the volume every node shares, laid out as in the checkout:
each rank runs ``python -m benchmarks.NAME`` with the volume on its PYTHONPATH)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: every module of the package, not a list of what the rank-side jobs import: a module split
#: off one of them would be missing on the nodes (pingpong.py was, once), and the rest are small
SCRIPTS = tuple(sorted(path.name for path in HERE.glob("*.py")))
#: the volume every node shares, and the package's copy on it
SHARED_ROOT = "/shared"
SHARED = f"{SHARED_ROOT}/benchmarks"
#: Hydra's options that let every rank import the copy: ``python -m benchmarks.NAME``
FROM_SHARED = ("-genv", "PYTHONPATH", SHARED_ROOT)
#: the line that starts a rank-side job's one-line JSON result
RESULT = "RESULT "


def local_mpiexec(ranks: int) -> list[str]:
    """The venv's mpiexec starting RANKS ranks on this machine."""
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks)]


def end_job_on_error() -> None:
    """Make an exception that ends this rank end the whole job (MPI_Abort), as ``python -m
    mpi4py`` does: otherwise the rank waits in MPI_Finalize for ranks that wait for it, and
    the job hangs until its timeout."""
    from mpi4py import MPI

    from launcher.faults import exits

    printed = sys.excepthook

    def abort(kind, value, trace) -> None:
        printed(kind, value, trace)
        sys.stderr.flush()
        exits.abort_mpi(MPI, 1)

    sys.excepthook = abort


def report(result: dict) -> None:
    """Print RESULT as a job's result line (rank 0 only)."""
    print(RESULT + json.dumps(result), flush=True)


def result_of(stdout: str) -> dict[int, float]:
    """The result line of a job's output, keyed by message size."""
    line = next(x for x in stdout.splitlines() if x.startswith(RESULT))
    return {int(k): v for k, v in json.loads(line.removeprefix(RESULT)).items()}


def copy_to(node0: str) -> None:
    """Copy SCRIPTS into container NODE0's shared volume (SHARED), in one tar stream: one exec,
    not one ``docker cp`` per file."""
    archive = subprocess.run(["tar", "-c", "-C", str(HERE), *SCRIPTS], check=True,
                             capture_output=True, timeout=60).stdout
    subprocess.run(["docker", "exec", "-i", node0, "sh", "-c",
                    f"mkdir -p {SHARED} && tar -x -C {SHARED}"], input=archive, check=True,
                   timeout=60)
