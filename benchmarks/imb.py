"""A second reference: Intel MPI's own benchmark, ``IMB-MPI1 Allreduce``, from the impi-rt wheel.

    pip install --prefix ~/impi impi-rt
    .venv/bin/python -m benchmarks.imb --prefix ~/impi --json benchmarks/results/imb.json

IMB-MPI1 Allreduce (float32 MPI_SUM, 4 KiB to 64 MiB) with Intel MPI's own mpiexec on 2 ranks
of this machine (shared memory), taking turns with benchmarks/allreduce.py (the mpi backend and
raw mpi4py over the venv's MPICH): the two need different MPIs, hence different jobs, so they
alternate job by job, ``--rounds`` times each. Each size's row gives the medians over the rounds
and the median of each round's ratio IMB / backend. ``benchmarks/cluster.py --imb PREFIX`` does
the same across the cluster's nodes (Intel MPI over libfabric's tcp provider, started over
ssh). IMB reports the mean of every rank's average over the calls, on a cache-warm buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks import ROOT, rank_side
from benchmarks.units import human

#: 4 KiB to 64 MiB, the sizes of benchmarks/allreduce.py
MSGLOG = "12:26"
#: IMB's calls per size: fixed, not IMB's own policy, so that every size is measured alike
ITERATIONS = 100
#: IMB's seconds per size (default 10): on a loaded machine the 64 MiB row's 100 calls took
#: longer, and IMB left the row out
TIME_LIMIT = "600"
TIMEOUT = 600


def imb_argv(prefix: str, ranks: int, hosts: list[str] | None = None,
             ssh: str = "ssh", iterations: int = ITERATIONS) -> list[str]:
    """Intel MPI's mpiexec running IMB-MPI1 Allreduce, ITERATIONS calls per size; across
    HOSTS one rank each, started with SSH (a command that takes ssh's arguments)."""
    where = (["-bootstrap", "ssh", "-bootstrap-exec", ssh, "-hosts", ",".join(hosts), "-ppn",
              "1"] if hosts else ["-bootstrap", "fork"])
    fabric = "ofi" if hosts else "shm"
    return [f"{prefix}/bin/mpiexec.hydra", *where, "-n", str(ranks),
            "-genv", "LD_LIBRARY_PATH", f"{prefix}/lib", "-genv", "I_MPI_FABRICS", fabric,
            "-genv", "FI_PROVIDER", "tcp",
            f"{prefix}/bin/IMB-MPI1", "Allreduce", "-msglog", MSGLOG, "-iter_policy", "off",
            "-iter", str(iterations), "-time", TIME_LIMIT]


def parse(output: str) -> dict[int, float]:
    """IMB's table: bytes -> average microseconds per call (the empty message left out)."""
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 5 and all(f.replace(".", "", 1).isdigit() for f in fields):
            nbytes, t_avg = int(fields[0]), float(fields[4])
            if nbytes:
                rows[nbytes] = t_avg
    if not rows:
        raise SystemExit(f"no IMB-MPI1 table in its output:\n{output}")
    return rows


def alternate(run_allreduce: Callable[[], dict], run_imb: Callable[[], dict[int, float]],
              rounds: int) -> tuple[dict, list[dict]]:
    """The all_reduce job and IMB taking turns, ROUNDS times each: the last all_reduce result
    (benchmarks/allreduce.py's JSON) and the rows that compare the two."""
    runs = []
    for _ in range(rounds):
        result = run_allreduce()
        runs.append((result, run_imb()))
    return result, compare(runs)


def compare(runs: list[tuple[dict, dict[int, float]]]) -> list[dict]:
    """Per size that IMB measured too: medians over the rounds, and the median of the rounds'
    ratios IMB / backend (each from one round, side by side)."""
    rows = []
    for size in (row["bytes"] for row in runs[0][0]["allreduce"]):
        if size not in runs[0][1]:
            continue
        ours = [next(r for r in result["allreduce"] if r["bytes"] == size) for result, _ in runs]
        theirs = [imb[size] for _, imb in runs]
        rows.append({
            "bytes": size, "rounds": len(runs),
            "imb_us": statistics.median(theirs),
            "mpi4py_median_us": statistics.median(r["mpi4py_median_us"] for r in ours),
            "raw_median_us": statistics.median(r["raw_median_us"] for r in ours),
            "imb_vs_mpi4py": statistics.median(t / r["mpi4py_median_us"]
                                               for t, r in zip(theirs, ours, strict=True))})
    return rows


def print_table(rows: list[dict], where: str) -> None:
    print(f"\nIMB-MPI1 Allreduce (Intel MPI, {where}) beside the mpi backend, taking turns: "
          f"us per call, median of {rows[0]['rounds']} rounds")
    print(f"{'size':>8} {'IMB avg':>10} {'mpi backend':>12} {'raw mpi4py':>11} "
          f"{'IMB / backend':>14}")
    for r in rows:
        size = r["bytes"]
        print(f"{human(size):>8} {r['imb_us']:>10.1f} {r['mpi4py_median_us']:>12.1f} "
              f"{r['raw_median_us']:>11.1f} {r['imb_vs_mpi4py']:>13.2f}x")
    print("IMB / backend > 1: the mpi backend (over the image's MPICH) is faster than Intel MPI")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", required=True, help="where impi-rt is installed (--prefix)")
    parser.add_argument("--rounds", type=int, default=3, help="jobs of each, taking turns")
    parser.add_argument("--iterations", type=int, default=ITERATIONS,
                        help="IMB's calls per size")
    parser.add_argument("--allreduce-args", default="",
                        help="more arguments for benchmarks/allreduce.py, e.g. '--seconds 0.2'")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    env = {**os.environ, "LD_LIBRARY_PATH": f"{args.prefix}/lib"}
    with tempfile.TemporaryDirectory(prefix="ddp-imb-") as tmp:
        out = Path(tmp) / "allreduce.json"
        allreduce_argv = [*rank_side.local_mpiexec(2), sys.executable,
                          "-m", "benchmarks.allreduce", "--json", str(out),
                          *shlex.split(args.allreduce_args)]

        def run_allreduce() -> dict:
            subprocess.run(allreduce_argv, check=True, capture_output=True, timeout=TIMEOUT,
                           cwd=ROOT)
            return json.loads(out.read_text())

        def run_imb() -> dict[int, float]:
            argv = imb_argv(args.prefix, 2, iterations=args.iterations)
            return parse(subprocess.run(argv, env=env, check=True,
                                        capture_output=True, text=True, timeout=TIMEOUT).stdout)

        _, rows = alternate(run_allreduce, run_imb, args.rounds)
    print_table(rows, "2 ranks, one node")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
