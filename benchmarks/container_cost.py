"""What the container costs: all_reduce through ch-run against the same ranks in the venv.

    .venv/bin/python benchmarks/container_cost.py --image DIR \
        --json benchmarks/results/container_cost.json

DIR is the cpu image converted for Charliecloud (``invoke chimage``). Each round starts the
host's Hydra ``mpiexec -n 2`` once per contender, in turn, so that load from other processes
falls on all of them alike:

- ``venv``: the ranks run the venv's Python on the host (MPICH from the venv);
- ``ch-run``: each rank runs in the image (``mpiexec ... ch-run --set-env IMG -- python``), the
  hybrid model with the image's MPICH and its defaults (CMA off, see docs/image.md);
- ``venv, CMA off``: the venv again with ``MPIR_CVAR_CH4_CMA_ENABLE=0``, to tell the cost of
  the container from the cost of that setting;
- ``ch-run --join, CMA on``: the ranks of the node share one container (``--join``), so
  MPICH's single-copy transfers work between them, and CMA is switched back on.

Every contender times ``dist.all_reduce`` of the mpi4py backend at each size (each call after
a barrier, counted as its slowest rank took) and reports the median call; the summary is the
median over the rounds, and the ratio is venv time / contender time (1.0: no cost). Rank 0
of each run prints one JSON line that the driver reads. Writes the table, the JSON and a PNG.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # also inside ch-run, where the checkout is bound at MOUNT

from benchmarks import rank_side  # noqa: E402
from benchmarks.units import human  # noqa: E402

SIZES = (1 << 20, 16 << 20)
#: where the repository is bound in the image (one of its empty mount points)
MOUNT = "/scratch"


def worker(sizes: list[int], calls: int) -> None:
    """One rank: time the backend's all_reduce; rank 0 prints ``{"size": median_s, ...}``."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from launcher.env import detect_environment
    from launcher.process_group import process_group

    with process_group(detect_environment(), "mpi") as ctx:
        result = {}
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4)
            times = []
            for _ in range(calls + 3):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
            result[str(nbytes)] = float(np.median(times[3:]))  # the first calls warm up
        if ctx.env.is_main:
            rank_side.report(result)


def contenders(image: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv before the worker's arguments, extra environment)."""
    here = Path(__file__).relative_to(ROOT)
    mpiexec = rank_side.local_mpiexec(2)
    venv = [*mpiexec, sys.executable, str(ROOT / here)]

    def ch_run(*options: str) -> list[str]:
        # options after the plain --set-env, so that an option's variable beats the image's
        return [*mpiexec, "ch-run", "-b", f"{ROOT}:{MOUNT}", "--set-env",
                *options, str(image), "--", "python", f"{MOUNT}/{here}"]

    return {
        "venv": (venv, {}),
        "ch-run": (ch_run(), {}),
        "venv, CMA off": (venv, {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}),
        # Hydra exports no count of a node's ranks that ch-run understands: count and tag named
        "ch-run --join, CMA on": (ch_run("--join-ct=2", f"--join-tag=ddp-bench-{os.getpid()}",
                                         "--set-env=MPIR_CVAR_CH4_CMA_ENABLE=1"), {}),
    }


def run_once(argv: list[str], extra: dict[str, str], calls: int) -> dict[str, float]:
    env = {**os.environ, "USER": os.environ.get("USER") or getpass.getuser(), **extra,
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*argv, "--worker", "--calls", str(calls)], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return rank_side.result_of(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=Path, help="Charliecloud image directory of ddp:cpu")
    parser.add_argument("--json", type=Path, help="write the results here (and a .png beside)")
    parser.add_argument("--rounds", type=int, default=5, help="turns each contender takes")
    parser.add_argument("--calls", type=int, default=60, help="calls per size and run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(list(SIZES), args.calls)
        return
    if args.image is None:
        parser.error("--image DIR is required (make it with `invoke chimage`)")
    runs = contenders(args.image.resolve())
    samples: dict[str, list[dict[int, float]]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, (argv, extra) in runs.items():
            samples[name].append(run_once(argv, extra, args.calls))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    median = {name: {size: statistics.median(run[size] for run in runs_)
                     for size in SIZES} for name, runs_ in samples.items()}
    print(f"{'size':>8}  " + "  ".join(f"{name:>22}" for name in runs))
    for size in SIZES:
        venv = median["venv"][size]
        cells = [f"{m[size] * 1e3:8.3f} ms ({venv / m[size]:4.2f}x)" for m in median.values()]
        print(f"{human(size):>8}  " + "  ".join(f"{cell:>22}" for cell in cells))
    print("(x: venv time / contender time; 1.00x = the same speed as the venv)")
    if args.json:
        record = {"sizes": list(SIZES), "rounds": args.rounds, "calls": args.calls,
                  "median_s": {n: {str(s): v for s, v in m.items()} for n, m in median.items()},
                  "rounds_s": {n: [{str(s): v for s, v in r.items()} for r in rs]
                               for n, rs in samples.items()},
                  "ratio_venv_over": {n: {str(s): median["venv"][s] / m[s] for s in SIZES}
                                      for n, m in median.items()}}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        plot(median, args.json.with_suffix(".png"))


def plot(median: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(median)
    for index, (name, times) in enumerate(median.items()):
        positions = [i + index * width for i in range(len(SIZES))]
        axes.bar(positions, [times[s] * 1e3 for s in SIZES], width, label=name)
    axes.set_xticks([i + width * (len(median) - 1) / 2 for i in range(len(SIZES))],
                    [f"all_reduce {human(s)}" for s in SIZES])
    axes.set_ylabel("median call (ms), 2 ranks")
    axes.set_title("The container's cost: mpi4py backend, venv vs ch-run")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
