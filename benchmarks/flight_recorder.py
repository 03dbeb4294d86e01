"""What the flight recorder (``launcher.faults.flight_recorder``) costs: per call and per step.

    .venv/bin/python -m benchmarks.flight_recorder --json benchmarks/results/flight_recorder.json

One process, a gloo group of one rank (no peer to wait for, so the call's own cost is all
there is). Three measurements, each with and without the recorder, taking turns in rounds so
that load from other processes falls on both alike; the best tenth of a round of each:

- ``wrapper``: the recorder's wrapper around a function that does nothing (its whole cost);
- ``all_reduce 4 KiB``: ``dist.all_reduce`` of 1024 floats;
- ``step``: a training step of launcher.train's default MLP under DDP (batch 32, SGD) plus the
  ``all_reduce`` of the loss that a training loop makes to log it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.faults import flight_recorder as fr
from launcher.training.models import build_model


def per_call(op, calls: int) -> float:
    """Seconds per call of the fastest batch of ``calls`` split in 10: short batches, so that
    on a loaded machine some run without being preempted."""
    batch = max(1, calls // 10)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(batch):
            op()
        best = min(best, (time.perf_counter() - start) / batch)
    return best


def contenders() -> dict[str, tuple]:
    """name -> (calls per round, the op without the recorder, the op with it)."""
    nothing = lambda *args, **kwargs: None  # noqa: E731
    wrapped = fr._wrap("all_reduce", nothing, 0, 2)
    tensor = torch.ones(1024)
    spec = build_model("mlp", 10, dropout=0.0)
    model = DDP(spec.module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, labels = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))

    def step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss.detach())

    return {"wrapper": (20000, lambda: nothing(tensor), lambda: wrapped(tensor)),
            "all_reduce 4 KiB": (5000, lambda: dist.all_reduce(tensor), None),
            "step": (50, step, None)}


def measure(rounds: int) -> list[dict]:
    results = {}
    for name, (calls, plain, recorded) in contenders().items():
        best = {"without": float("inf"), "with": float("inf")}
        for _ in range(rounds):
            for mode in ("without", "with"):
                if recorded is None:
                    (fr.install if mode == "with" else fr.uninstall)()
                op = plain if recorded is None or mode == "without" else recorded
                best[mode] = min(best[mode], per_call(op, calls))
        fr.uninstall()
        results[name] = best
    return [{"measure": name, "without_us": 1e6 * t["without"], "with_us": 1e6 * t["with"],
             "overhead_us": 1e6 * (t["with"] - t["without"]),
             "overhead_pct": 100 * (t["with"] / t["without"] - 1)}
            for name, t in results.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per measurement")
    args = parser.parse_args()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"{'measure':>18} {'without us':>11} {'with us':>9} {'overhead us':>12} {'%':>6}")
    for r in rows:
        print(f"{r['measure']:>18} {r['without_us']:>11.2f} {r['with_us']:>9.2f} "
              f"{r['overhead_us']:>12.2f} {r['overhead_pct']:>6.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "results": rows}, indent=2)
                             + "\n")


if __name__ == "__main__":
    main()
