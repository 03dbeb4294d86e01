"""The benchmark scripts that run on the ranks of a compose cluster, and how they get there: the
image holds launcher/ but not benchmarks/, so node0 gets them on the volume every node shares,
laid out as in the checkout (allreduce.py imports its helpers as ``benchmarks.*``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: what the rank-side jobs import or run
SCRIPTS = ("allreduce.py", "floor.py", "timing.py", "tuning.py")
#: where every node finds them
SHARED = "/shared/benchmarks"


def copy_to(node0: str) -> str:
    """Copy SCRIPTS into container NODE0's shared volume; their directory there."""
    subprocess.run(["docker", "exec", node0, "mkdir", "-p", SHARED], check=True, timeout=60)
    for name in SCRIPTS:
        subprocess.run(["docker", "cp", str(HERE / name), f"{node0}:{SHARED}/{name}"],
                       check=True, timeout=60)
    return SHARED
