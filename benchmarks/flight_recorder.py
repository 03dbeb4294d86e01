"""What the flight recorder (``launcher.faults.flight_recorder``) costs: per call and per step.

    .venv/bin/python -m benchmarks.flight_recorder --before e0bb7a3 \
        --json benchmarks/results/flight_recorder.json

One process, a gloo group of one rank (no peer to wait for, so the call's own cost is all
there is). Three measurements, each without the recorder, with it, and (``--before REV``) with
the recorder of an earlier commit read from git, taking turns in rounds so that load from other
processes falls on all alike; the best tenth of a round of each:

- ``wrapper``: the recorder's wrapper around a function that does nothing (its whole cost);
- ``all_reduce 4 KiB``: ``dist.all_reduce`` of 1024 floats;
- ``step``: a training step of launcher.train's default MLP under DDP (batch 32, SGD) plus the
  ``all_reduce`` of the loss that a training loop makes to log it, DDP's own reducer in every
  column; with the recorder its backward is recorded as the process group does for every DDP
  (``launcher.faults.ddp_steps``);
- ``step, torch's hook``: the same step with torch's ``allreduce_hook`` in every column (a
  Python communication hook, whose ``all_reduce`` the wrapper records too), which tells the
  price of any Python communication hook from that of the recording.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.faults import ddp_steps
from launcher.faults import flight_recorder as fr
from launcher.training.models import build_model

REPO = Path(__file__).resolve().parents[1]


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


def before(revision: str) -> types.ModuleType:
    """``launcher/faults/flight_recorder.py`` as it was at ``revision``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:launcher/faults/flight_recorder.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("flight_recorder_before")
    module.__file__ = fr.__file__
    sys.modules[module.__name__] = module  # dataclasses look the module up
    exec(compile(source, f"{revision}:launcher/faults/flight_recorder.py", "exec"),
         module.__dict__)
    return module


def contenders(recorders: dict) -> dict[str, tuple]:
    """name -> (calls per round, whether the op runs with its mode's recorder installed,
    mode -> the op)."""
    def nothing(tensor, op=None, group=None, async_op=False):  # all_reduce's parameters
        return None

    tensor = torch.ones(1024)
    wrapped = {mode: nothing if recorder is None else recorder._wrap("all_reduce", nothing, 0, 2)
               for mode, recorder in recorders.items()}
    images, labels = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))

    def stepper(hook):
        torch.manual_seed(0)
        model = DDP(build_model("mlp", 10, dropout=0.0).module)
        if hook is not None:
            model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            dist.all_reduce(torch.zeros(1))
        return step

    steps = {mode: stepper(None) for mode in recorders}
    return {"wrapper": (20000, False, {mode: (lambda op=op: op(tensor))
                                       for mode, op in wrapped.items()}),
            "all_reduce 4 KiB": (5000, True,
                                 dict.fromkeys(recorders, lambda: dist.all_reduce(tensor))),
            "step": (100, True, steps),
            "step, torch's hook": (100, True, {mode: stepper(default_hooks.allreduce_hook)
                                               for mode in recorders})}


class Recording:
    """The recorder as the process group installs it: the wrapped functions and every DDP's
    backward."""

    _wrap = staticmethod(fr._wrap)

    @staticmethod
    def install() -> None:
        fr.install()
        ddp_steps.install()

    @staticmethod
    def uninstall() -> None:
        fr.uninstall()
        ddp_steps.uninstall()


def measure(rounds: int, recorders: dict) -> list[dict]:
    results = {}
    for name, (calls, installs, ops) in contenders(recorders).items():
        best = dict.fromkeys(recorders, float("inf"))
        for _ in range(rounds):
            for mode, recorder in recorders.items():
                for other in recorders.values():
                    if other is not None:
                        other.uninstall()
                if recorder is not None and installs:
                    recorder.install()
                best[mode] = min(best[mode], per_call(ops[mode], calls))
        results[name] = best
    for recorder in recorders.values():
        if recorder is not None:
            recorder.uninstall()
    rows = []
    for name, t in results.items():
        row = {"measure": name, **{f"{mode}_us": 1e6 * t[mode] for mode in recorders}}
        for mode in recorders:
            if mode != "without":
                row[f"{mode}_overhead_us"] = 1e6 * (t[mode] - t["without"])
                row[f"{mode}_overhead_pct"] = 100 * (t[mode] / t["without"] - 1)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per measurement")
    parser.add_argument("--before", metavar="REV",
                        help="also measure the recorder of this git commit, side by side")
    args = parser.parse_args()
    recorders = {"without": None, **({"before": before(args.before)} if args.before else {}),
                 "with": Recording}
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several threads on a loaded machine time the load, not the step
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = measure(args.rounds, recorders)
    finally:
        dist.destroy_process_group()
    modes = list(recorders)
    print(f"{'measure':>20} " + " ".join(f"{m + ' us':>11}" for m in modes)
          + " " + " ".join(f"{m + ' +us':>11} {'%':>6}" for m in modes[1:]))
    for r in rows:
        print(f"{r['measure']:>20} " + " ".join(f"{r[m + '_us']:>11.2f}" for m in modes) + " "
              + " ".join(f"{r[m + '_overhead_us']:>11.2f} {r[m + '_overhead_pct']:>6.1f}"
                         for m in modes[1:]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "before": args.before,
                                         "load_average": os.getloadavg(), "results": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
