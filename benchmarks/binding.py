"""Training throughput with and without CPU binding, side by side: one job per variant.

    .venv/bin/python -m benchmarks.binding --json benchmarks/results/binding.json

Each variant is ``mpiexec -n RANKS python -m launcher.train --bind MODE`` on this machine
(``none``: the ranks' threads wander over every core; ``auto``: each rank bound to its own
cores, launcher/placement/cpus.py). The variants take turns, one job each per round, so that
the machine's drift falls on all alike; a job's throughput is the median ``samples_per_s`` of
its metrics records after the first (which holds the warm-up), and the table gives each
variant's median over the rounds and its ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT

RUN_TIMEOUT = 600
VARIANTS = ("none", "auto")
#: a CPU-bound step: the CNN on synthetic images, batches large enough to use several threads
TRAIN = ["--model", "cnn", "--dataset", "synthetic", "--global-batch-size", "128",
         "--log-every", "5", "--checkpoint-every", "0", "--backend", "gloo"]


def run_job(ranks: int, mode: str, steps: int, work: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    argv = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable,
            "-m", "launcher.train", *TRAIN, "--bind", mode, "--max-steps", str(steps),
            "--run-dir", str(run_dir), "--data-dir", str(work / "data")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr}")
    rates = [r["samples_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
             if r.get("event") == "step"]
    return statistics.median(rates[1:] or rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    found: dict[str, list[float]] = {mode: [] for mode in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ddp-binding-") as work:
        for _ in range(args.rounds):
            for mode in VARIANTS:
                found[mode].append(run_job(args.ranks, mode, args.steps, Path(work)))
    median = {mode: statistics.median(rates) for mode, rates in found.items()}
    reference = median[VARIANTS[0]]
    print(f"{'--bind':8}  {'samples/s':>10}  {'vs none':>7}  rounds")
    for mode in VARIANTS:
        print(f"{mode:8}  {median[mode]:10.0f}  {median[mode] / reference:7.2f}  "
              + " ".join(f"{rate:.0f}" for rate in found[mode]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ranks": args.ranks, "steps": args.steps,
                                         "rounds": found, "median": median}, indent=1) + "\n")


if __name__ == "__main__":
    main()
