"""What the flight recorder (``launcher.faults.flight_recorder``) costs: per call and per step.

    .venv/bin/python -m benchmarks.flight_recorder --before e0bb7a3 \
        --json benchmarks/results/flight_recorder.json

One process, a gloo group of one rank (no peer to wait for, so the call's own cost is all
there is). Three measurements, each without the recorder, with it, and (``--before REV``) with
the recorder of an earlier commit read from git, taking turns in rounds so that load from other
processes falls on all alike. A round times each mode's best tenth of its calls; the table gives
the best round of each mode and, as its cost, the median over rounds of the difference from
the same round's "without" (paired: a change of load between rounds cancels; on this VM two
identical columns differed by up to 15 µs a step in their best rounds):

- ``wrapper``: the recorder's wrapper around a function that does nothing (its whole cost);
- ``all_reduce 4 KiB``: ``dist.all_reduce`` of 1024 floats;
- ``step``: a training step of launcher.train's default MLP under DDP (batch 32, SGD) plus the
  ``all_reduce`` of the loss that a training loop makes to log it, DDP's own reducer in every
  column; with the recorder its backward is recorded as the process group does for every DDP
  (``launcher.faults.ddp_steps``);
- ``step, torch's hook``: the same step with torch's ``allreduce_hook`` in every column (a
  Python communication hook, whose ``all_reduce`` the wrapper records too), which tells the
  price of any Python communication hook from that of the recording;
- ``all_reduce 4 KiB, nccl`` where CUDA is: on an nccl group of one, with the event the
  recorder keeps per nccl call.

Beside the times, the Python and C functions one op of each measurement calls in each mode
(``sys.setprofile``): what the recorder adds, counted exactly where the times are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.faults import ddp_steps
from launcher.faults import flight_recorder as fr
from launcher.placement.ports import free_port
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


def warm_up(op, calls: int) -> None:
    """A tenth of a round's calls, untimed: the first calls after an install run new code
    objects that Python has not specialised yet (the first steps with the recorder just
    installed took ~0.1 ms more each, which the best batch of a round mostly hid)."""
    for _ in range(max(1, calls // 10)):
        op()


def _module_at(revision: str, name: str, **names: types.ModuleType) -> types.ModuleType | None:
    """``launcher/faults/NAME.py`` as it was at ``revision``, as a module of its own whose
    imports of ``launcher.faults``' ``names`` get the modules given; None where it did not
    exist."""
    shown = subprocess.run(["git", "show", f"{revision}:launcher/faults/{name}.py"],
                           cwd=REPO, capture_output=True, text=True)
    if shown.returncode:
        return None
    module = types.ModuleType(f"{name}_before")
    module.__file__ = fr.__file__
    sys.modules[module.__name__] = module  # dataclasses look the module up
    with _standing_in(names):
        exec(compile(shown.stdout, f"{revision}:launcher/faults/{name}.py", "exec"),
             module.__dict__)
    return module


@contextlib.contextmanager
def _standing_in(names: dict[str, types.ModuleType]) -> Iterator[None]:
    """``launcher.faults.NAME`` is the module given while an older module's imports run,
    whichever form they take (``from launcher.faults import NAME``, ``import ... as``)."""
    package = sys.modules["launcher.faults"]
    # the modules named are imported at the top of this file: there is always one to put back
    saved = {name: getattr(package, name) for name in names}
    try:
        for name, module in names.items():
            setattr(package, name, module)
            sys.modules[f"{package.__name__}.{name}"] = module
        yield
    finally:
        for name, module in saved.items():
            setattr(package, name, module)
            sys.modules[f"{package.__name__}.{name}"] = module


class Before:
    """The recorder of an earlier commit as its process group installed it: its wrapped
    functions and, where it had them, its DDP steps."""

    def __init__(self, revision: str):
        self.recorder = _module_at(revision, "flight_recorder")
        self.steps = _module_at(revision, "ddp_steps", flight_recorder=self.recorder)
        self._wrap = self.recorder._wrap

    def install(self) -> None:
        self.recorder.install()
        if self.steps is not None:
            self.steps.install()

    def uninstall(self) -> None:
        self.recorder.uninstall()
        if self.steps is not None:
            self.steps.uninstall()


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

    # one DDP per contender, every mode timing it: two DDPs built alike took up to 15 µs a
    # step apart here, as much as the recording costs
    step, hooked = stepper(None), stepper(default_hooks.allreduce_hook)
    return {"wrapper": (20000, False, {mode: (lambda op=op: op(tensor))
                                       for mode, op in wrapped.items()}),
            "all_reduce 4 KiB": (5000, True,
                                 dict.fromkeys(recorders, lambda: dist.all_reduce(tensor))),
            "step": (100, True, dict.fromkeys(recorders, step)),
            "step, torch's hook": (100, True, dict.fromkeys(recorders, hooked)),
            **_on_a_gpu(recorders)}


def _on_a_gpu(recorders: dict) -> dict[str, tuple]:
    """Where CUDA is: a 4 KiB all_reduce on an nccl group of one (the recorder keeps an event
    per call, to tell a call that returned from one whose kernel finished)."""
    if not torch.cuda.is_available():
        return {}
    group, tensor = dist.new_group(backend="nccl"), torch.ones(1024, device="cuda")
    return {"all_reduce 4 KiB, nccl": (5000, True, dict.fromkeys(
        recorders, lambda: dist.all_reduce(tensor, group=group)))}


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


def function_calls(op) -> tuple[int, int]:
    """The Python and the C functions that one ``op`` calls, counted by ``sys.setprofile``: the
    work the recorder adds, free of the machine's noise (on this VM a step's time moved by
    more than the recorder costs)."""
    counts = {"call": 0, "c_call": 0}

    def profile(_frame, event, _arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        op()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


def switch_to(recorders: dict, recorder) -> None:
    """``recorder`` alone installed (None: none)."""
    for other in recorders.values():
        if other is not None:
            other.uninstall()
    if recorder is not None:
        recorder.install()


def ready(recorders: dict, mode: str, installs: bool, op, calls: int) -> None:
    """``mode``'s recorder alone installed (where the measurement installs one), warmed up."""
    switch_to(recorders, recorders[mode] if installs else None)
    warm_up(op, calls)


def measure(rounds: int, recorders: dict) -> list[dict]:
    shuffle = random.Random(0).shuffle
    results, calls_made = {}, {}
    for name, (calls, installs, ops) in contenders(recorders).items():
        times = {mode: [] for mode in recorders}
        order = list(recorders)
        for _ in range(rounds):
            shuffle(order)  # no mode always runs right after the same other one
            for mode in order:
                ready(recorders, mode, installs, ops[mode], calls)
                times[mode].append(per_call(ops[mode], calls))
        calls_made[name] = {}
        for mode in recorders:
            ready(recorders, mode, installs, ops[mode], calls)
            calls_made[name][mode] = function_calls(ops[mode])
        results[name] = times
    switch_to(recorders, None)
    rows = []
    for name, t in results.items():
        row = {"measure": name, **{f"{mode}_us": 1e6 * min(t[mode]) for mode in recorders},
               **{f"{mode}_calls": calls_made[name][mode] for mode in recorders}}
        for mode in recorders:
            if mode != "without":
                paired = float(np.median(np.subtract(t[mode], t["without"])))
                row[f"{mode}_overhead_us"] = 1e6 * paired
                row[f"{mode}_overhead_pct"] = 100 * paired / float(np.median(t["without"]))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per measurement")
    parser.add_argument("--before", metavar="REV",
                        help="also measure the recorder of this git commit, side by side")
    args = parser.parse_args()
    recorders = {"without": None, **({"before": Before(args.before)} if args.before else {}),
                 "with": Recording}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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
    print("function calls per op, Python / C:")
    for r in rows:
        print(f"{r['measure']:>20} " + "   ".join(f"{m} {r[m + '_calls'][0]} / {r[m + '_calls'][1]}"
                                               for m in modes))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "before": args.before,
                                         "load_average": os.getloadavg(), "results": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
