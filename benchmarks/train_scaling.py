"""Training throughput of ``python -m launcher.train`` on this machine's CPUs, 1 vs 2 ranks.

    .venv/bin/python -m benchmarks.train_scaling --json benchmarks/results/train_scaling.json

Each measurement is a real ``mpiexec -n R python -m launcher.train`` run on the synthetic
dataset; its JSON-lines metrics give the numbers. Warm-up intervals are dropped; of the rest the
best interval's samples/s and the smallest step times count (the median is kept in the JSON):
on a shared machine the least disturbed interval is the least noisy estimate of what the code
costs. Each rank runs one torch thread by default (``--threads 1``): 1 rank on one core against
2 ranks on two, the classic one-process-per-core DDP comparison; a 2-thread single rank on a
shared 2-core machine spends most of its time in OpenMP barriers and would flatter DDP.

- Strong scaling (MLP, DDP): the same global batch B on 1 and 2 ranks; speedup = rate2 / rate1,
  efficiency = speedup / 2; the crossover is the smallest B at which two ranks beat one. "step
  speedup" divides the smallest 1-rank step time by the smallest 2-rank ``--sync manual`` step
  time (T_comp + T_sync): what the code costs when nothing else competes for the cores.
- The synchronous-SGD split (``--sync manual``, 2 ranks): T_comp (step time without the
  all-reduce) and T_sync (the all-reduce, timed exactly) per step. With c the compute time per
  sample of one rank, one rank takes c*B per step and two take c*B/2 + T_sync, so two ranks
  win above B* = 2 * T_sync / c: the predicted crossover, printed beside the measured one.
- Weak scaling (CNN, DDP): the default 32 samples per rank; efficiency = rate2 / (2 x rate1),
  goal >= 0.8. A control run separates what the machine costs from what the job costs: two
  independent 1-rank runs at the same time ("2 apart": the same cores busy, nothing exchanged).
  efficiency = machine x sync, with machine = rate(2 apart) / (2 x rate1) (shared caches,
  memory bandwidth, clock speed with more cores busy, hyper-thread siblings) and
  sync = rate2 / rate(2 apart) (collectives, waiting for the slower rank, DDP's own work).
  A third 2-rank run per backend ("bcast"; the CNN plus one buffer outside batch norm) makes
  launcher.train broadcast every buffer from rank 0 before each forward, DDP's default, which
  it skips for batch-norm statistics: the saving, measured side by side.
  The weak-scaling runs are repeated in rounds (``--repeats``) and the median counts: on a
  shared VM the speed of one core drifts by 10 % within minutes, and one lucky 1-rank run moves
  a single efficiency figure as much.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT

MPIEXEC = Path(sys.executable).parent / "mpiexec"
WARMUP_INTERVALS = 2
#: the CNN with buffers broadcast before every forward, as a --model spec each rank imports
CNN_BROADCASTING = "benchmarks.train_scaling:cnn_broadcasting_buffers"


def cnn_broadcasting_buffers():
    """The CNN plus a buffer outside batch norm: launcher.train then cannot rule out that the
    training forward reads one, and keeps DDP's broadcast of all buffers before every forward."""
    import torch

    from launcher.training.models import cnn

    model = cnn()
    model.register_buffer("unread", torch.zeros(()))
    return model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--backends", default="gloo,mpi", help="comma-separated backends")
    parser.add_argument("--batches", default="16,64,256,1024",
                        help="global batch sizes for strong scaling")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=5, help="steps per metrics interval")
    parser.add_argument("--weak-only", action="store_true",
                        help="only the weak-scaling runs (CNN), a few minutes less")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of the weak-scaling runs (the median counts)")
    parser.add_argument("--mpiexec-args", default="",
                        help="extra mpiexec options, e.g. '-bind-to core'")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (0: cores / ranks, launcher.train's default)")
    return parser.parse_args()


class Job:
    """One ``mpiexec -n R python -m launcher.train`` run on the synthetic dataset, started now."""

    def __init__(self, ranks: int, backend: str, model: str, batch: int, sync: str, args,
                 mpiexec_args: str = ""):
        self.record = {"ranks": ranks, "backend": backend, "model": model,
                       "global_batch": batch, "sync": sync}
        self._tmp = tempfile.TemporaryDirectory()
        tmp = self._tmp.name
        self.command = [str(MPIEXEC), *shlex.split(mpiexec_args), "-n", str(ranks),
                        sys.executable, "-m", "launcher.train", "--dataset", "synthetic",
                        "--model", model, "--global-batch-size", str(batch),
                        "--backend", backend, "--sync", sync, "--epochs", "1000",
                        "--max-steps", str(args.steps), "--log-every", str(args.log_every),
                        "--checkpoint-every", "0", "--threads", str(args.threads),
                        "--run-dir", tmp, "--data-dir", tmp]
        self._process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)

    def result(self) -> dict:
        """Wait for the run; its best and median samples/s and smallest step times (seconds)."""
        with self._tmp:
            _, stderr = self._process.communicate(timeout=600)
            if self._process.returncode != 0:
                sys.exit(f"failed: {' '.join(self.command)}\n{stderr}")
            lines = (Path(self._tmp.name) / "metrics.jsonl").read_text().splitlines()
        return summarize(lines, self.record)


def summarize(metrics_lines: list[str], record: dict) -> dict:
    """``record`` with the run's best and median samples/s and smallest step times (seconds),
    from launcher.train's metrics.jsonl, warm-up intervals dropped."""
    records = [r for r in map(json.loads, metrics_lines)
               if r["event"] == "step"][WARMUP_INTERVALS:]
    return {
        **record,
        "samples_per_s": max(r["samples_per_s"] for r in records),
        "samples_per_s_median": statistics.median(r["samples_per_s"] for r in records),
        **{k: min(r[k] for r in records) for k in ("t_step", "t_comm", "t_compute",
                                                   "t_forward", "t_backward", "t_optimizer")},
    }


class Runs:
    """Runs jobs, prints one line per measurement and keeps every record for the JSON."""

    def __init__(self, args):
        self.args, self.records = args, []

    def one(self, ranks: int, backend: str, model: str, batch: int, sync: str = "ddp") -> dict:
        found = Job(ranks, backend, model, batch, sync, self.args,
                    self.args.mpiexec_args).result()
        self.records.append(found)
        print(f"  measured {ranks} rank(s) {backend} {model} B={batch} {sync}: "
              f"{found['samples_per_s']:.0f} samples/s", flush=True)
        return found

    def side_by_side(self, model: str, batch: int) -> float:
        """Samples/s of two independent 1-rank runs at the same time: 2 ranks minus talking.

        Each run's best interval counts, as everywhere here; the two need not fall at the same
        moment, which can only flatter the machine and so understate the sync factor. They get
        no --mpiexec-args: bound, each would take the first core, the same one."""
        jobs = [Job(1, "gloo", model, batch, "ddp", self.args) for _ in range(2)]
        found = [job.result() for job in jobs]
        self.records.extend(found)
        rate = sum(f["samples_per_s"] for f in found)
        print(f"  measured 2 independent 1-rank runs {model} B={batch}: {rate:.0f} samples/s "
              "together", flush=True)
        return rate


def strong_scaling(runs: Runs, backends: list[str], batches: list[int]) -> dict:
    strong, split = [], []
    for batch in batches:
        one = runs.one(1, "gloo", "mlp", batch)  # one rank never communicates: any backend
        for backend in backends:
            two = runs.one(2, backend, "mlp", batch)
            manual = runs.one(2, backend, "mlp", batch, "manual")
            speedup = two["samples_per_s"] / one["samples_per_s"]
            strong.append({"global_batch": batch, "backend": backend,
                           "rate_1": one["samples_per_s"], "rate_2": two["samples_per_s"],
                           "speedup": speedup, "efficiency": speedup / 2,
                           # what the step itself costs, without the machine's other load
                           "step_speedup": one["t_step"] / manual["t_step"]})
            split.append({"global_batch": batch, "backend": backend,
                          "t_comp_ms": 1e3 * manual["t_compute"],
                          "t_sync_ms": 1e3 * manual["t_comm"],
                          "rate_manual_2": manual["samples_per_s"]})
    crossover = {b: next((s["global_batch"] for s in strong
                          if s["backend"] == b and s["speedup"] > 1), None) for b in backends}
    # compute per sample from the largest single-rank batch (least overhead per sample)
    per_sample = min(r["t_step"] / r["global_batch"] for r in runs.records if r["ranks"] == 1
                     and r["model"] == "mlp")
    predicted = {b: 2 * statistics.median(t["t_sync_ms"] for t in split if t["backend"] == b)
                 / 1e3 / per_sample for b in backends}

    print("\nStrong scaling, MLP, DDP (same global batch on 1 and 2 ranks)")
    print(f"{'batch':>6} {'backend':>8} {'1 rank/s':>10} {'2 ranks/s':>10} {'speedup':>8} "
          f"{'eff':>6} {'T_comp ms':>10} {'T_sync ms':>10} {'step speedup':>13}")
    for s, t in zip(strong, split, strict=True):
        print(f"{s['global_batch']:>6} {s['backend']:>8} {s['rate_1']:>10.0f} {s['rate_2']:>10.0f} "
              f"{s['speedup']:>8.2f} {s['efficiency']:>6.2f} {t['t_comp_ms']:>10.2f} "
              f"{t['t_sync_ms']:>10.2f} {s['step_speedup']:>13.2f}")
    for backend, batch in crossover.items():
        found = (f"from global batch {batch} on" if batch else f"never in {batches}")
        print(f"{backend}: two ranks beat one {found}; predicted B* = 2 T_sync / c = "
              f"{predicted[backend]:.0f} (c = {per_sample * 1e6:.1f} us/sample)")
    return {"strong": strong, "sync_split": split, "crossover_batch": crossover,
            "predicted_crossover_batch": predicted, "compute_s_per_sample": per_sample}


def weak_scaling(runs: Runs, backends: list[str], repeats: int) -> dict:
    weak, parts = [], {}
    # rounds of all runs, one after another: a drift of the machine's speed falls on all alike
    for repeat in range(repeats):
        one = runs.one(1, "gloo", "cnn", 32)
        parts.setdefault("1 rank", []).append(one)
        apart = runs.side_by_side("cnn", 32)
        for backend in backends:
            two = runs.one(2, backend, "cnn", 64)
            parts.setdefault(f"2 ranks {backend}", []).append(two)
            bcast = runs.one(2, backend, CNN_BROADCASTING, 64)
            weak.append({"repeat": repeat, "backend": backend, "per_rank_batch": 32,
                         "rate_1": one["samples_per_s"], "rate_2": two["samples_per_s"],
                         "rate_2_independent": apart,
                         "efficiency": two["samples_per_s"] / (2 * one["samples_per_s"]),
                         "machine_efficiency": apart / (2 * one["samples_per_s"]),
                         "sync_efficiency": two["samples_per_s"] / apart,
                         "rate_2_bcast": bcast["samples_per_s"],
                         "bcast_efficiency": bcast["samples_per_s"] / (2 * one["samples_per_s"])})
    summary = {}
    for backend in backends:
        mine = [w for w in weak if w["backend"] == backend]
        summary[backend] = {
            **{f"median_{k}": statistics.median(w[k] for w in mine)
               for k in ("efficiency", "machine_efficiency", "sync_efficiency",
                         "bcast_efficiency")},
            "min_efficiency": min(w["efficiency"] for w in mine),
            "max_efficiency": max(w["efficiency"] for w in mine)}

    print(f"\nWeak scaling, CNN, DDP, 32 samples per rank, {repeats} round(s) "
          "(goal: efficiency >= 0.8)")
    print(f"{'round':>5} {'backend':>8} {'1 rank/s':>9} {'2 apart/s':>10} {'2 ranks/s':>10} "
          f"{'efficiency':>11} {'= machine':>10} {'x sync':>7} {'bcast':>6}")
    for w in weak:
        print(f"{w['repeat']:>5} {w['backend']:>8} {w['rate_1']:>9.0f} "
              f"{w['rate_2_independent']:>10.0f} {w['rate_2']:>10.0f} {w['efficiency']:>11.2f} "
              f"{w['machine_efficiency']:>10.2f} {w['sync_efficiency']:>7.2f} "
              f"{w['bcast_efficiency']:>6.2f}")
    for backend, m in summary.items():
        print(f"{'median':>5} {backend:>8} {'':>9} {'':>10} {'':>10} "
              f"{m['median_efficiency']:>11.2f} {m['median_machine_efficiency']:>10.2f} "
              f"{m['median_sync_efficiency']:>7.2f} {m['median_bcast_efficiency']:>6.2f}   "
              f"(efficiency {m['min_efficiency']:.2f} to "
              f"{m['max_efficiency']:.2f})")
    print("2 apart: two independent 1-rank runs at the same time (no communication); machine = "
          "2 apart / (2 x 1 rank), sync = 2 ranks / 2 apart; bcast: the efficiency with every "
          "buffer broadcast before each forward (DDP's default)")

    keys = ("t_step", "t_forward", "t_backward", "t_comm", "t_optimizer")
    breakdown = {run: {k: statistics.median(r[k] for r in found) for k in keys}
                 for run, found in parts.items()}
    print("\nWhere a step goes (ms; smallest per run, median over rounds; backward includes "
          "the all-reduce's wait)")
    print(f"{'run':>14}" + "".join(f"{k[2:]:>10}" for k in keys))
    for run, t in breakdown.items():
        print(f"{run:>14}" + "".join(f"{1e3 * t[k]:>10.2f}" for k in keys))
    return {"weak": weak, "weak_summary": summary, "weak_step_breakdown": breakdown}


def cpu_topology() -> dict[str, str]:
    """What decides whether two busy cores slow each other down, as lscpu tells it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
            "NUMA node(s)", "Hypervisor vendor")
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in keep if k in fields}


def main() -> None:
    args = parse_args()
    backends = args.backends.split(",")
    runs = Runs(args)
    results = {}
    if not args.weak_only:
        results.update(strong_scaling(runs, backends, [int(b) for b in args.batches.split(",")]))
    results.update(weak_scaling(runs, backends, args.repeats))
    # other work on the machine moves these numbers more than anything in the code does
    load = os.getloadavg()
    print(f"\nload average after the runs: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**results, "runs": runs.records, "steps": args.steps,
                                         "threads": args.threads,
                                         "mpiexec_args": args.mpiexec_args,
                                         "cpus": os.cpu_count(), "cpu": cpu_topology(),
                                         "load_average": load},
                                        indent=2) + "\n")
        from benchmarks import plots

        bars = [{"label": f"{backend}, 2 ranks", "efficiency": m["median_efficiency"],
                 "goal": 0.8} for backend, m in results["weak_summary"].items()]
        title = "Weak scaling, CNN, DDP (median of rounds)"
        print(f"wrote {plots.scaling(bars, title, args.json)}")


if __name__ == "__main__":
    main()
