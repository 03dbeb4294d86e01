"""Weak scaling of the CNN across the nodes of a running compose cluster, one rank per node.

benchmarks/cluster.py calls ``weak_scaling`` between its other measurements; the format is
benchmarks/train_scaling.py's, with N nodes in place of 2 ranks:

- efficiency = rate(N ranks) / (N x rate(1 rank)), per backend; goal >= 0.85 with mpi;
- machine = rate(N apart) / (N x rate(1 rank)), where "N apart" are N independent 1-rank runs
  at the same time, one per node: what the nodes cost each other with nothing exchanged (on
  one VM the containers share its cores);
- sync = rate(N ranks) / rate(N apart): what talking costs, the part a backend decides.

Every run is ``python -m launcher.train`` on the synthetic dataset inside the cluster (Hydra's
mpiexec over ssh from node0 for N ranks), its metrics read from the shared volume. A run's rate
is its MEDIAN interval's samples/s (train_scaling.py takes the best): the N apart runs start a
little apart, and a best interval could fall in a moment when one of them ran alone. The runs
are repeated in rounds and the median round counts, as in train_scaling.py.
"""

from __future__ import annotations

import statistics
import subprocess
import time

from benchmarks.train_scaling import summarize
from ddp_tasks import compose_spec as cs

RUN_TIMEOUT = 600
PER_RANK_BATCH = 32
#: steps per run: a few seconds of training, so that runs started together overlap throughout
STEPS = 400


def _train_args(backend: str, batch: int, steps: int, run_dir: str) -> list[str]:
    return ["python", "-m", "launcher.train", "--dataset", "synthetic", "--model", "cnn",
            "--global-batch-size", str(batch), "--backend", backend, "--epochs", "1000",
            "--max-steps", str(steps), "--log-every", "5", "--checkpoint-every", "0",
            "--threads", "1", "--run-dir", run_dir, "--data-dir", run_dir]


def _result(prefix: str, run_dir: str, record: dict) -> dict:
    lines = subprocess.run(["docker", "exec", prefix + "node0", "cat", f"{run_dir}/metrics.jsonl"],
                           check=True, capture_output=True, text=True, timeout=60).stdout
    return summarize(lines.splitlines(), record)


def _start(container: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["docker", "exec", container, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, what: str) -> None:
    _, stderr = process.communicate(timeout=RUN_TIMEOUT)
    if process.returncode != 0:
        raise SystemExit(f"{what} failed ({process.returncode}):\n{stderr}")


def one_per_node(prefix: str, hosts: list[str], backend: str, steps: int) -> dict:
    """One job, one rank on each of ``hosts``, ``PER_RANK_BATCH`` samples per rank."""
    run_dir = f"/shared/scaling/{time.time_ns()}"
    n = len(hosts)
    argv = [*cs.mpiexec_one_per_node(hosts),
            *_train_args(backend, PER_RANK_BATCH * n, steps, run_dir)]
    _finish(_start(prefix + "node0", argv), f"{n} ranks over {backend}")
    return _result(prefix, run_dir, {"ranks": n, "backend": backend})


def apart(prefix: str, hosts: list[str], steps: int) -> float:
    """Samples/s of independent 1-rank runs, one per node at the same time, added up."""
    runs = []
    for host in hosts:
        run_dir = f"/shared/scaling/{time.time_ns()}"
        runs.append((run_dir, _start(prefix + host, _train_args("gloo", PER_RANK_BATCH, steps,
                                                                 run_dir))))
    for _, process in runs:
        _finish(process, "a 1-rank run beside the others")
    return sum(_result(prefix, run_dir, {"ranks": 1})["samples_per_s_median"]
               for run_dir, _ in runs)


def weak_scaling(prefix: str, hosts: list[str], backends: list[str], repeats: int,
                 steps: int = STEPS) -> dict:
    """Rounds of: 1 rank on node0, N apart, N ranks per backend; the median efficiencies."""
    n = len(hosts)
    rounds = []
    for repeat in range(repeats):
        one = one_per_node(prefix, hosts[:1], "gloo", steps)["samples_per_s_median"]
        together = apart(prefix, hosts, steps)
        for backend in backends:
            rate = one_per_node(prefix, hosts, backend, steps)["samples_per_s_median"]
            rounds.append({"repeat": repeat, "backend": backend, "rate_1": one,
                           "rate_n_independent": together, "rate_n": rate,
                           "efficiency": rate / (n * one),
                           "machine_efficiency": together / (n * one),
                           "sync_efficiency": rate / together})
            print(f"  round {repeat} {backend}: efficiency {rounds[-1]['efficiency']:.2f}",
                  flush=True)
    summary = {backend: {f"median_{k}": statistics.median(r[k] for r in rounds
                                                          if r["backend"] == backend)
                         for k in ("efficiency", "machine_efficiency", "sync_efficiency")}
               for backend in backends}
    return {"nodes": n, "per_rank_batch": PER_RANK_BATCH, "steps": steps, "rounds": rounds,
            "summary": summary}


def print_table(result: dict) -> None:
    n = result["nodes"]
    print(f"\nWeak scaling across {n} nodes, CNN, DDP, {result['per_rank_batch']} samples per "
          f"rank, one rank per node, {len(result['rounds']) // len(result['summary'])} round(s)")
    print(f"{'round':>5} {'backend':>8} {'1 rank/s':>9} {f'{n} apart/s':>10} "
          f"{f'{n} ranks/s':>10} {'efficiency':>11} {'= machine':>10} {'x sync':>7}")
    for r in result["rounds"]:
        print(f"{r['repeat']:>5} {r['backend']:>8} {r['rate_1']:>9.0f} "
              f"{r['rate_n_independent']:>10.0f} {r['rate_n']:>10.0f} {r['efficiency']:>11.2f} "
              f"{r['machine_efficiency']:>10.2f} {r['sync_efficiency']:>7.2f}")
    for backend, m in result["summary"].items():
        print(f"{'median':>5} {backend:>8} {'':>9} {'':>10} {'':>10} "
              f"{m['median_efficiency']:>11.2f} {m['median_machine_efficiency']:>10.2f} "
              f"{m['median_sync_efficiency']:>7.2f}")
    print(f"{n} apart: {n} independent 1-rank runs at the same time, one per node; machine = "
          f"{n} apart / ({n} x 1 rank), sync = {n} ranks / {n} apart")
