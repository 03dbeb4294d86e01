"""DDP step time on the compiled mpi backend, the Python one and gloo, beside compute alone.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.ddp_step \
        --json benchmarks/results/ddp_step.json

The model: 8 linear layers of 512 x 512 (1 MiB of float32 gradients each) and DDP buckets of
1 MiB, so that each layer's gradients are a bucket of their own (8 or more buckets), reduced
while backward computes the layers below. One step is forward, backward and an SGD step on one
torch thread per rank. "compute" is the same step without DDP (no communication): a backend
whose all_reduces overlap backward has a step time close to it; one that reduces every bucket
inside backward (the Python backend: its collectives finish inside the call) pays compute plus
every bucket's all_reduce. Each step counts as long as its slowest rank took; the contenders
take turns in rounds (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.allreduce import init_groups
from benchmarks.timing import COMM, measure

LAYERS, WIDTH, BATCH = 8, 512, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    parser.add_argument("--rounds", type=int, default=6, help="turns each contender takes")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="time budget per contender, all rounds together")
    parser.add_argument("--max-calls", type=int, default=300, help="steps per contender at most")
    return parser.parse_args()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def stepper(module: torch.nn.Module):
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad()
        module(x).square().mean().backward()
        optimizer.step()
    return step


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    groups = init_groups()
    steps = {"compute": stepper(model())}
    for name, group in groups.items():
        ddp = torch.nn.parallel.DistributedDataParallel(model(), process_group=group,
                                                        bucket_cap_mb=1)
        steps[name] = stepper(ddp)
    stats = measure(steps, args)
    if COMM.rank == 0:
        compute = stats["compute"]["median"]
        print(f"DDP step, {LAYERS} layers of {WIDTH}x{WIDTH} (>= {LAYERS} buckets of 1 MiB), "
              f"batch {BATCH}, {COMM.size} ranks, one thread each: median (best) ms per step")
        for name, s in stats.items():
            extra = "" if name == "compute" else \
                f"   communication not hidden: {(s['median'] - compute) * 1e3:6.1f} ms"
            print(f"{name:>8}: {s['median'] * 1e3:7.1f} ({s['best'] * 1e3:7.1f}){extra}")
        if args.json:
            args.json.write_text(json.dumps({
                "command": " ".join(sys.argv), "world_size": COMM.size,
                "layers": LAYERS, "width": WIDTH, "batch": BATCH, "bucket_cap_mb": 1,
                "torch": torch.__version__, "load_average": os.getloadavg(),
                "step_ms": {n: {k: v * 1e3 if k != "calls" else v for k, v in s.items()}
                            for n, s in stats.items()},
            }, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
