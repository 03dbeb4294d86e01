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

Step minus compute is more than communication: DDP's own work (copying gradients into buckets,
its hooks) costs time with no peer at all. Two more contenders, on the compiled backend where it
is built (else the Python one), split the two: "ddp alone", DDP on each rank's group of one
(DDP's own cost, nothing to wait for), and "serial", the compute step followed by one
all_reduce per bucket, one after another (the communication with nothing to hide it). What
backward hid is then serial + ddp alone - compute - the backend's step: above zero, the
buckets' all_reduces overlapped backward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from benchmarks import timing
from benchmarks.allreduce import init_groups
from benchmarks.timing import COMM, measure

LAYERS, WIDTH, BATCH = 8, 512, 64


def parse_args() -> argparse.Namespace:
    return timing.parser(__doc__, rounds=6, seconds=6.0, max_calls=300, per="contender",
                         calls="steps per contender").parse_args()


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


def serial(group: dist.ProcessGroup):
    """The compute step, then one all_reduce per bucket (a layer's weight and bias), in turn."""
    step = stepper(model())
    buckets = [torch.zeros(WIDTH * WIDTH + WIDTH) for _ in range(LAYERS)]

    def run() -> None:
        step()
        for bucket in buckets:
            dist.all_reduce(bucket, group=group)
    return run


def ddp(group: dist.ProcessGroup):
    return stepper(torch.nn.parallel.DistributedDataParallel(model(), process_group=group,
                                                             bucket_cap_mb=1))


def hidden_ms(stats: dict, backend: str) -> dict[str, float]:
    """Per statistic, what backward hid of the serial all_reduces (ms; > 0: overlap)."""
    return {stat: 1e3 * (stats["serial"][stat] + stats["ddp alone"][stat]
                         - stats["compute"][stat] - stats[backend][stat])
            for stat in ("median", "best")}


def report(stats: dict, backend: str, args) -> None:
    compute = stats["compute"]["median"]
    print(f"DDP step, {LAYERS} layers of {WIDTH}x{WIDTH} (>= {LAYERS} buckets of 1 MiB), "
          f"batch {BATCH}, {COMM.size} ranks, one thread each: median (best) ms per step")
    for name, s in stats.items():
        extra = "" if name in ("compute", "serial", "ddp alone") else \
            f"   communication not hidden: {(s['median'] - compute) * 1e3:6.1f} ms"
        print(f"{name:>9}: {s['median'] * 1e3:7.1f} ({s['best'] * 1e3:7.1f}){extra}")
    hidden = hidden_ms(stats, backend)
    print(f"serial and ddp alone on {backend}: backward hid {hidden['median']:.2f} "
          f"({hidden['best']:.2f}) ms of {backend}'s all_reduces")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "world_size": COMM.size,
            "layers": LAYERS, "width": WIDTH, "batch": BATCH, "bucket_cap_mb": 1,
            "torch": torch.__version__, "load_average": os.getloadavg(),
            "step_ms": {n: {k: v * 1e3 if k != "calls" else v for k, v in s.items()}
                        for n, s in stats.items()},
            "serial_backend": backend, "hidden_ms": hidden,
        }, indent=2) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    groups = init_groups()
    backend = next(iter(groups))  # the compiled one where built, else the Python one
    solo, _ = dist.new_subgroups(group_size=1, backend=dist.get_backend(groups[backend]))
    steps = {"compute": stepper(model()), "serial": serial(groups[backend]),
             "ddp alone": ddp(solo), **{name: ddp(group) for name, group in groups.items()}}
    stats = measure(steps, args)
    if COMM.rank == 0:
        report(stats, backend, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
