"""MPICH's algorithm for the mpi backend's all_reduce, side by side: one job per variant.

    .venv/bin/python -m benchmarks.tuning --json benchmarks/results/tuning.json
    .venv/bin/python -m benchmarks.tuning --nodes 3 --json benchmarks/results/tuning-3node.json

A variant is MPICH's algorithm for the non-blocking all_reduce the backend calls (an
environment variable, read when MPI starts, hence one job per variant): its own choice, or the
ring that launcher/mpi/library.py asks for where the ring measured faster. The variants take
turns, one job each per round, so that the machine's drift falls on all alike; each job times
the backend's all_reduce (``dist.all_reduce`` on the mpi4py group, float32) from 4 KiB to
64 MiB as benchmarks/allreduce.py does, and the table gives each variant's bus bandwidth
(median of the rounds' medians) and its ratio to the first variant. On one node the jobs are
local ``mpiexec -n 2``; with ``--nodes N`` they run on a compose cluster of N containers, one
rank each (``invoke cluster.up``, torn down at the end).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import ROOT, rank_side
from benchmarks.units import bus_factor, human

ALGORITHM = "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM"
#: a job's default bound (``--job-timeout``). Its ranks dump every thread's stack and exit
#: STACKS_BEFORE seconds earlier, so that a job that hangs says where, in the error, instead of
#: being killed without a word
RUN_TIMEOUT = 600
STACKS_BEFORE = 20

#: (label, MPICH's algorithm for the non-blocking all_reduce): the first is the reference
VARIANTS = [("MPICH's own choice", "auto"), ("ring (tsp_ring)", "tsp_ring")]


def variant_job(args) -> None:
    """One variant's job: the backend's all_reduce per size; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    from benchmarks import allreduce
    from benchmarks.timing import COMM, measure

    rank_side.end_job_on_error()
    faulthandler.dump_traceback_later(max(1, args.job_timeout - STACKS_BEFORE), exit=True)
    ours = allreduce.init_groups()["mpi4py"]
    bus = bus_factor(COMM.size)
    row = {}
    for nbytes in allreduce.SIZES:
        buffer = torch.zeros(nbytes // 4)
        stats = measure({"mpi4py": lambda b=buffer: dist.all_reduce(b, group=ours)},
                        args)["mpi4py"]
        row[nbytes] = nbytes / stats["median"] / 1e9 * bus
    if COMM.rank == 0:
        rank_side.report(row)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def job_argv(launch: list[str], script: list[str], algorithm: str, seconds: float,
             job_timeout: float = RUN_TIMEOUT) -> list[str]:
    """LAUNCH (an mpiexec command line) running SCRIPT (python -m this module) as one
    variant."""
    return [*launch, "-genv", ALGORITHM, algorithm, *script, "--rank-side", "--seconds",
            str(seconds), "--job-timeout", str(job_timeout)]


def run_job(argv: list[str], job_timeout: float = RUN_TIMEOUT) -> dict[int, float]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=job_timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as late:  # hung before the ranks armed their stacks
        raise SystemExit(f"no end after {job_timeout:.0f} s: {' '.join(argv)}\n"
                         f"{late.stdout or ''}{late.stderr or ''}") from None
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n"
                         f"{done.stdout}{done.stderr}")
    return rank_side.result_of(done.stdout)


def compare(launch: list[str], script: list[str], variants: list, rounds: int,
            seconds: float, job_timeout: float = RUN_TIMEOUT) -> dict:
    """Every variant once per round; per variant and size the median bus GB/s of the rounds."""
    found: dict[str, list[dict[int, float]]] = {label: [] for label, _ in variants}
    for _ in range(rounds):
        for label, algorithm in variants:
            argv = job_argv(launch, script, algorithm, seconds, job_timeout)
            found[label].append(run_job(argv, job_timeout))
    sizes = sorted(found[variants[0][0]][0])
    busbw = {label: {size: statistics.median(r[size] for r in runs) for size in sizes}
             for label, runs in found.items()}
    reference = busbw[variants[0][0]]
    return {"busGBps": busbw, "vs_first": {label: {s: row[s] / reference[s] for s in sizes}
                                           for label, row in busbw.items()},
            "rounds": rounds}


def print_table(result: dict, where: str) -> None:
    sizes = sorted(next(iter(result["busGBps"].values())))
    print(f"\nmpi backend all_reduce, {where}: bus GB/s (median of {result['rounds']} rounds), "
          "and x the first row")
    print(f"{'variant':20}" + "".join(f"{human(s):>15}" for s in sizes))
    for label, row in result["busGBps"].items():
        ratios = result["vs_first"][label]
        print(f"{label:20}" + "".join(f"{row[s]:>7.2f} ({ratios[s]:.2f}x)" for s in sizes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1, help="1: this machine; more: compose")
    parser.add_argument("--rounds", type=int, default=4, help="jobs per variant")
    parser.add_argument("--seconds", type=float, default=0.4,
                        help="time budget per size in each job")
    parser.add_argument("--image", default="ddp:cpu", help="project image (--nodes > 1)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--job-timeout", type=float, default=RUN_TIMEOUT,
                        help="seconds a job may take; a hung one prints its ranks' stacks")
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-calls", type=int, default=2000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        variant_job(args)
        return 0

    if args.nodes == 1:
        where = "2 ranks on one node"
        launch = rank_side.local_mpiexec(2)
        result = compare(launch, [sys.executable, "-m", "benchmarks.tuning"], VARIANTS,
                         args.rounds, args.seconds, args.job_timeout)
    else:
        where = f"{args.nodes} nodes, one rank each"
        result = across_nodes(args, VARIANTS)
    print_table(result, where)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "where": where,
                                         "load_average": os.getloadavg(), **result},
                                        indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def on_cluster(node0: str, hosts: list[str]) -> tuple[list[str], list[str]]:
    """``(launch, script)`` of the jobs on a running compose cluster, one rank on each of HOSTS;
    the package is copied to its shared volume first."""
    from ddp_tasks import compose_spec as cs  # not in the image, where the ranks import this

    rank_side.copy_to(node0)
    return (["docker", "exec", node0, *cs.mpiexec_one_per_node(hosts), *rank_side.FROM_SHARED],
            ["python", "-m", "benchmarks.tuning"])


def across_nodes(args, variants: list) -> dict:
    """The jobs on a compose cluster started for them, with both scripts on its shared volume."""
    from ddp_tasks import cluster as cl
    from ddp_tasks import compose_spec as cs

    project = f"ddptuning{os.getpid()}"
    prefix = f"{project}-"
    try:
        cl.up_mpi(args.nodes, project, prefix, args.image)
        launch, script = on_cluster(f"{prefix}node0", cs.hosts(args.nodes))
        return compare(launch, script, variants, args.rounds, args.seconds, args.job_timeout)
    finally:
        left = cl.remove(project, cl.mpi_compose_file(args.nodes, project))
        if left:
            print(f"the benchmark cluster left behind: {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
