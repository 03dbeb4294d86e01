"""A second reference: Intel MPI's own benchmark, ``IMB-MPI1 Allreduce``, from the impi-rt wheel.

    pip install --prefix ~/impi impi-rt
    .venv/bin/python benchmarks/imb.py --prefix ~/impi \
        --against benchmarks/results/allreduce.json --json benchmarks/results/imb.json

Runs IMB-MPI1 Allreduce (float32 MPI_SUM, 4 KiB to 64 MiB) with Intel MPI's own mpiexec on 2
ranks of this machine (shared memory) and prints its average time per call beside the mpi
backend's and raw mpi4py's from an all_reduce JSON of benchmarks/allreduce.py.
``benchmarks/cluster.py --imb PREFIX`` runs the same across the cluster's nodes (Intel MPI over
libfabric's tcp provider, started over ssh), right after the all_reduce table. IMB reports the
mean of every rank's average over the calls, not a median: a reference, not a contender of the
interleaved run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

#: 4 KiB to 64 MiB, the sizes of benchmarks/allreduce.py
MSGLOG = "12:26"
ITERATIONS = "100"
TIMEOUT = 600


def imb_argv(prefix: str, ranks: int, hosts: list[str] | None = None,
             ssh: str = "ssh") -> list[str]:
    """Intel MPI's mpiexec running IMB-MPI1 Allreduce; across HOSTS one rank each, started
    with SSH (a command that takes ssh's arguments)."""
    where = (["-bootstrap", "ssh", "-bootstrap-exec", ssh, "-hosts", ",".join(hosts), "-ppn",
              "1"] if hosts else ["-bootstrap", "fork"])
    fabric = "ofi" if hosts else "shm"
    return [f"{prefix}/bin/mpiexec.hydra", *where, "-n", str(ranks),
            "-genv", "LD_LIBRARY_PATH", f"{prefix}/lib", "-genv", "I_MPI_FABRICS", fabric,
            "-genv", "FI_PROVIDER", "tcp",
            f"{prefix}/bin/IMB-MPI1", "Allreduce", "-msglog", MSGLOG, "-iter_policy", "off",
            "-iter", ITERATIONS]


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


def compare(imb: dict[int, float], allreduce: dict) -> list[dict]:
    """One row per size of the all_reduce result that IMB measured too."""
    return [{"bytes": row["bytes"], "imb_us": imb[row["bytes"]],
             "mpi4py_median_us": row["mpi4py_median_us"], "raw_median_us": row["raw_median_us"],
             "imb_vs_mpi4py": imb[row["bytes"]] / row["mpi4py_median_us"]}
            for row in allreduce["allreduce"] if row["bytes"] in imb]


def print_table(rows: list[dict], where: str) -> None:
    print(f"\nIMB-MPI1 Allreduce (Intel MPI, {where}) beside the mpi backend: us per call")
    print(f"{'size':>8} {'IMB avg':>10} {'mpi backend':>12} {'raw mpi4py':>11} "
          f"{'IMB / backend':>14}")
    for r in rows:
        size = r["bytes"]
        human = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"{human:>8} {r['imb_us']:>10.1f} {r['mpi4py_median_us']:>12.1f} "
              f"{r['raw_median_us']:>11.1f} {r['imb_vs_mpi4py']:>13.2f}x")
    print("IMB / backend > 1: the mpi backend (over the image's MPICH) is faster than Intel MPI")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", required=True, help="where impi-rt is installed (--prefix)")
    parser.add_argument("--against", type=Path, required=True,
                        help="an all_reduce JSON of benchmarks/allreduce.py (2 ranks, here)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    env = {**os.environ, "LD_LIBRARY_PATH": f"{args.prefix}/lib"}
    output = subprocess.run(imb_argv(args.prefix, 2), env=env, check=True, capture_output=True,
                            text=True, timeout=TIMEOUT).stdout
    rows = compare(parse(output), json.loads(args.against.read_text()))
    print_table(rows, "2 ranks, one node")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
