"""Compose cluster benchmark: start-up, first step, all_reduce and weak scaling across nodes.

    .venv/bin/python -m benchmarks.cluster [--image ddp:cpu] [--nodes 2] [--imb PREFIX] \
        [--json PATH]

Starts an MPI cluster of NODES containers with the project's own code (``invoke cluster.up``),
times ``invoke run --runtime docker`` until rank 0 logs its first training step, runs
benchmarks/allreduce.py across the nodes, one rank each (gloo, the mpi4py backend and raw
mpi4py against the link's floor), the CNN's weak scaling with each backend
(benchmarks/cluster_scaling.py), tears the cluster down, prints the tables and writes JSON;
the all_reduce result also as ``allreduce-<N>node.json`` and the weak scaling as
``scaling-<N>node.json``, each with its plot beside it. With ``--imb PREFIX`` the all_reduce
job takes turns with Intel MPI's IMB-MPI1 (benchmarks/imb.py), ``--imb-rounds`` jobs of each;
the all_reduce table is the last round's.
Goals: the first training step less than 5 s after the cluster is healthy; weak-scaling
efficiency >= 0.85 with mpi.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import RESULTS, ROOT, cluster_scaling, imb, plots, rank_side
from ddp_tasks import cluster as cl
from ddp_tasks import compose_spec as cs

GOALS = {"first_step_s": 5.0, "mpi_weak_scaling_efficiency": 0.85}
FIRST_STEP = re.compile(r"\bstep 1\b")
RUN_TIMEOUT = 600


def time_to_first_step(project: str, prefix: str, nodes: int) -> tuple[float, float]:
    """Seconds from ``invoke run`` to rank 0's first step log line, and to the end of the run."""
    argv = [sys.executable, "-m", "invoke", "run", "--runtime", "docker", "--nodes", str(nodes),
            "--prefix", prefix, "--module", "launcher.train", "--args",
            f"--epochs 1 --log-every 1 --global-batch-size {32 * nodes} "
            f"--run-dir /shared/bench/{time.time_ns()}"]
    start = time.monotonic()
    first = None
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        output = []
        for line in process.stdout:
            output.append(line)
            if first is None and FIRST_STEP.search(line):
                first = time.monotonic() - start
            if time.monotonic() - start > RUN_TIMEOUT:
                process.kill()
        status = process.wait(timeout=RUN_TIMEOUT)
    if status != 0 or first is None:
        raise SystemExit(f"training on the cluster failed ({status}):\n{''.join(output)}")
    return first, time.monotonic() - start


def allreduce(prefix: str, nodes: int, options: tuple[str, ...] = ()) -> dict:
    """benchmarks.allreduce across the nodes, one rank each, with OPTIONS; its JSON."""
    node0 = prefix + "node0"
    rank_side.copy_to(node0)
    table = subprocess.run(
        ["docker", "exec", node0, *cs.mpiexec_one_per_node(cs.hosts(nodes)),
         *rank_side.FROM_SHARED, "python", "-m", "benchmarks.allreduce",
         *options, "--json", "/shared/allreduce.json"], check=True,
        timeout=RUN_TIMEOUT, capture_output=True, text=True).stdout
    text = subprocess.run(["docker", "exec", node0, "cat", "/shared/allreduce.json"],
                          check=True, capture_output=True, text=True, timeout=60).stdout
    return {**json.loads(text), "table": table}


def imb_across(prefix: str, nodes: int, impi: str) -> dict[int, float]:
    """IMB-MPI1 Allreduce across the nodes with Intel MPI copied in from the host's ``impi``
    prefix (the shared volume gives every node the same path); bytes -> us per call."""
    node0 = prefix + "node0"
    subprocess.run(["docker", "cp", f"{impi}/.", f"{node0}:/shared/impi"], check=True,
                   timeout=RUN_TIMEOUT, capture_output=True)
    # Intel MPI's ssh through the cluster's wrapper, as Hydra's (see ssh-launch.sh)
    argv = imb.imb_argv("/shared/impi", nodes, cs.hosts(nodes),
                        ssh=f"{cs.CLUSTER_SCRIPTS}/ssh-launch.sh")
    output = subprocess.run(["docker", "exec", "-e", "LD_LIBRARY_PATH=/shared/impi/lib", node0,
                             *argv], check=True, timeout=RUN_TIMEOUT, capture_output=True,
                            text=True).stdout
    return imb.parse(output)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=cs.DEFAULT_IMAGE, help="project image (ddp:cpu)")
    parser.add_argument("--nodes", type=int, default=2, help="cluster size (default 2)")
    parser.add_argument("--json", default=str(RESULTS / "cluster.json"),
                        help="where to write the results (default: benchmarks/results/)")
    parser.add_argument("--scaling-repeats", type=int, default=3,
                        help="rounds of the weak-scaling runs (0: none)")
    parser.add_argument("--imb", metavar="PREFIX",
                        help="also run IMB-MPI1 Allreduce across the nodes with the Intel MPI "
                        "installed at PREFIX (pip install --prefix PREFIX impi-rt), taking "
                        "turns with the all_reduce benchmark")
    parser.add_argument("--imb-rounds", type=int, default=3,
                        help="with --imb: jobs of each, taking turns")
    parser.add_argument("--backends", default="mpi,gloo",
                        help="backends of the weak-scaling runs, comma-separated")
    return parser.parse_args()


def measure(args) -> dict:
    """Every measurement on a cluster started for them and removed afterwards."""
    project = f"ddpbench{os.getpid()}"
    prefix = f"{project}-"
    # other jobs on the machine move every figure: the load they made is part of the result
    results: dict[str, object] = {"nodes": args.nodes, "load_average": os.getloadavg()}
    try:
        results["healthy_s"] = cl.up_mpi(args.nodes, project, prefix, args.image)
        results["first_step_s"], results["run_s"] = time_to_first_step(project, prefix,
                                                                       args.nodes)
        if args.imb:
            results["allreduce"], rows = imb.alternate(
                lambda: allreduce(prefix, args.nodes),
                lambda: imb_across(prefix, args.nodes, args.imb), args.imb_rounds)
            results["allreduce"]["imb"] = rows
        else:
            results["allreduce"] = allreduce(prefix, args.nodes)
        if args.scaling_repeats:
            results["weak_scaling"] = cluster_scaling.weak_scaling(
                prefix, cs.hosts(args.nodes), args.backends.split(","), args.scaling_repeats)
    finally:
        left = cl.remove(project, cl.mpi_compose_file(args.nodes, project))
        shutil.rmtree(cs.RUNS_DIR / project, ignore_errors=True)
    if left:
        raise SystemExit(f"the benchmark cluster left behind: {left}")
    results["machine"] = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"
    return results


def report(results: dict, args) -> None:
    """The tables, and the JSON and plots beside ``--json``."""
    rows = [(f"{args.nodes}-node cluster: up to healthy", results["healthy_s"], None),
            ("invoke run to first training step", results["first_step_s"],
             GOALS["first_step_s"]),
            ("invoke run to the end (1 epoch of digits)", results["run_s"], None)]
    print(f"{'measure':44} {'value':>9}  {'goal':>8}  ok")
    for name, value, goal in rows:
        ok = "" if goal is None else ("yes" if value <= goal else "NO")
        print(f"{name:44} {value:>7.2f} s  {'' if goal is None else f'<= {goal} s':>8}  {ok}")
    # the nodes have no matplotlib: the table came from node0, the plot is drawn here
    print(results["allreduce"].pop("table"))
    if "imb" in results["allreduce"]:
        imb.print_table(results["allreduce"]["imb"], f"{args.nodes} nodes, one rank each")
    across = Path(args.json).with_name(f"allreduce-{args.nodes}node.json")
    across.write_text(json.dumps(results["allreduce"], indent=2) + "\n")
    print(f"wrote {across} and {plots.allreduce(results['allreduce'], across)}")
    if "weak_scaling" in results:
        scaling = results["weak_scaling"]
        cluster_scaling.print_table(scaling)
        path = Path(args.json).with_name(f"scaling-{args.nodes}node.json")
        path.write_text(json.dumps(scaling, indent=2) + "\n")
        bars = [{"label": f"{backend}, {args.nodes} nodes", "efficiency": m["median_efficiency"],
                 "goal": GOALS["mpi_weak_scaling_efficiency"]}
                for backend, m in scaling["summary"].items()]
        title = f"Weak scaling across {args.nodes} nodes, CNN, DDP (median of rounds)"
        print(f"wrote {path} and {plots.scaling(bars, title, path)}")
    Path(args.json).write_text(json.dumps({"results": results, "goals": GOALS}, indent=2) + "\n")
    print(f"wrote {args.json}")


def main() -> int:
    args = parse_args()
    report(measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
