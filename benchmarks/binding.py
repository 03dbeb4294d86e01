"""Training throughput with and without CPU binding, side by side: one job per variant.

    .venv/bin/python -m benchmarks.binding --ranks 2 4 --json benchmarks/results/binding.json

Each variant is ``mpiexec -n RANKS python -m launcher.train --bind MODE`` on this machine, on
CPU (GPUs hidden: the point is the cores), for each ``--ranks`` count (``none``: the ranks'
threads wander over every core; ``auto``: each rank bound to its own cores,
launcher/placement/cpus.py). The variants take turns, one job each per round, so that the
machine's drift falls on all alike; a job's throughput is the median ``samples_per_s`` of its
metrics records after the first (which holds the warm-up), and the table gives each variant's
median over the rounds and its ratio to ``none`` at the same rank count. The JSON, with the
host's CPUs and NUMA nodes, is rewritten after every round, so a run cut short keeps the rounds
it finished; its PNG is drawn beside it where matplotlib is installed (benchmarks.plots).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT, plots
from launcher.placement.cpus import format_cpulist, numa_nodes

RUN_TIMEOUT = 600
VARIANTS = ("none", "auto")
#: a CPU-bound step: the CNN on synthetic images, batches large enough to use several threads
TRAIN = ["--model", "cnn", "--dataset", "synthetic", "--global-batch-size", "128",
         "--log-every", "5", "--checkpoint-every", "0", "--backend", "gloo"]
BOUND = re.compile(r"cores: .*")


def run_job(ranks: int, mode: str, steps: int, work: Path) -> tuple[float, str]:
    """One job's throughput (samples/s) and rank 0's line on its binding ("" when unbound)."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    argv = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable,
            "-m", "launcher.train", *TRAIN, "--bind", mode, "--max-steps", str(steps),
            "--run-dir", str(run_dir), "--data-dir", str(work / "data")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT,
                          env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr}")
    rates = [r["samples_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
             if r.get("event") == "step"]
    bound = BOUND.search(done.stdout)
    return statistics.median(rates[1:] or rates), bound.group(0) if bound else ""


def host() -> dict:
    """The CPUs this run may use and the NUMA nodes they lie in."""
    allowed = os.sched_getaffinity(0)
    return {"cpus": format_cpulist(allowed),
            "numa_nodes": {str(n): format_cpulist(c) for n, c in numa_nodes().items()}}


def table(report: dict) -> str:
    lines = [f"{'ranks':>5}  {'--bind':8}  {'samples/s':>10}  {'vs none':>7}  rounds"]
    reference = {}
    for row in report["rows"]:
        median = row["median"]
        reference.setdefault(row["ranks"], median)
        lines.append(f"{row['ranks']:5}  {row['mode']:8}  {median:10.0f}  "
                     f"{median / reference[row['ranks']]:7.2f}  "
                     + " ".join(f"{rate:.0f}" for rate in row["rounds"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = [{"ranks": ranks, "mode": mode, "rounds": [], "bound": ""}
            for ranks in args.ranks for mode in VARIANTS]
    report = {"host": host(), "steps": args.steps, "rows": rows}
    with tempfile.TemporaryDirectory(prefix="ddp-binding-") as work:
        for _ in range(args.rounds):
            for row in rows:
                rate, row["bound"] = run_job(row["ranks"], row["mode"], args.steps, Path(work))
                row["rounds"].append(rate)
                row["median"] = statistics.median(row["rounds"])
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    if args.json:
        # matplotlib is the dev extra; without it: python -m benchmarks.plots JSON elsewhere
        with contextlib.suppress(ImportError):
            print(f"wrote {plots.binding(report, args.json)}")


if __name__ == "__main__":
    main()
