"""One all_reduce through each layer between torch's ``dist.all_reduce`` and MPI, on the
compiled backend, in one run: where issue 37's 1-4 MiB gap over raw MPI lies.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.allreduce_layers \
        --json benchmarks/results/allreduce_layers.json

The layers, all on one buffer (where a buffer lies counts as much as the gap,
benchmarks/README.md) and taking turns in rounds (benchmarks/timing.py):

- ``raw``: ``MPI_Allreduce`` on ``COMM_WORLD`` (mpi4py), the floor the goal measures against;
- ``nonblocking``: ``MPI_Iallreduce`` on a duplicate of it, polled with ``MPI_Test`` from
  Python: the MPI calls the backend makes, on the kind of communicator it has;
- ``backend``: the compiled ``c10d::Backend`` called directly (``asyncOp`` false: run in the
  caller's thread, as ``dist.all_reduce`` runs it), no torch dispatcher and no front end;
- ``process_group``: the same through the group's ``ProcessGroup`` (torch's dispatcher);
- ``dist``: ``dist.all_reduce`` on the group, what users call;
- ``raw_after_front_end`` (in rounds of its own, after the others): raw, timed alone, after an
  untimed ``dist.all_reduce`` of one float on this rank's group of one: whether torch's front
  end slows the MPI call after it.

Each layer's time minus the one below it is what that layer adds.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from benchmarks import plots, rank_side, timing
from benchmarks.allreduce import init_groups, solo_group
from benchmarks.timing import COMM
from benchmarks.units import human
from launcher.mpi import cxx as mpi_cxx

KiB = 1 << 10
SIZES = (16 * KiB, 256 * KiB, 1024 * KiB, 4096 * KiB)
LAYERS = ("raw", "nonblocking", "backend", "process_group", "dist")


def parse_args():
    parser = timing.parser(__doc__, rounds=6, seconds=0.6, max_calls=400, per="size and layer")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) * KiB for x in s.split(",")),
                        default=SIZES, help="sizes in KiB, comma-separated")
    return parser.parse_args()


def layer_ops(nbytes: int, group: dist.ProcessGroup, solo: dist.ProcessGroup,
              dup: MPI.Intracomm) -> tuple[dict, dict]:
    """The layers' calls on one buffer of zeros (sums stay finite), and the one timed after
    an untimed front-end call (``timing.sample``'s ``before``)."""
    t = torch.zeros(nbytes // 4)
    buf = t.numpy()
    backend = group._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # its default (true) hands the op to the progress thread
    one = torch.zeros(1)

    def nonblocking():
        request = dup.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        while not request.Test():
            pass

    def raw():
        COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    ops = {"raw": raw, "nonblocking": nonblocking,
           "backend": lambda: backend.allreduce([t], opts).wait(),
           "process_group": lambda: group.allreduce([t], opts).wait(),
           "dist": lambda: dist.all_reduce(t, group=group)}
    return ops, {"raw_after_front_end": (raw, lambda: dist.all_reduce(one, group=solo))}


def table(group, solo, args) -> list[dict]:
    dup = COMM.Dup()
    rows = []
    for nbytes in args.sizes:
        ops, after = layer_ops(nbytes, group, solo, dup)
        stats = timing.measure(ops, args)
        for name, (op, before) in after.items():
            stats[name] = timing.measure({name: op}, args, before=before)[name]
        row = {"bytes": nbytes}
        for name, stat in stats.items():
            for kind in ("median", "best"):
                row[f"{name}_{kind}_us"] = stat[kind] * 1e6
                row[f"{name}_minus_raw_{kind}_us"] = (stat[kind] - stats["raw"][kind]) * 1e6
        rows.append(row)
    dup.Free()
    return rows


def print_table(rows: list[dict]) -> None:
    names = (*LAYERS, "raw_after_front_end")
    print(f"all_reduce float32, {COMM.size} ranks, each layer's time minus raw MPI's: median "
          f"(best) us; raw: its own time")
    print(f"{'size':>8} " + " ".join(f"{n:>19}" for n in names))
    for row in rows:
        cells = [f"{row['raw_median_us']:8.1f} ({row['raw_best_us']:7.1f})"]
        cells += [f"{row[f'{n}_minus_raw_median_us']:8.1f} ({row[f'{n}_minus_raw_best_us']:7.1f})"
                  for n in names[1:]]
        print(f"{human(row['bytes']):>8} " + " ".join(f"{c:>19}" for c in cells))


def main() -> None:
    args = parse_args()
    rank_side.end_job_on_error()
    groups = init_groups()
    if mpi_cxx.BACKEND_NAME not in groups:
        sys.exit("error: the compiled mpi backend is not built, and its layers are what this "
                 "times\nHINT: .venv/bin/python -m launcher.mpi.cxx")
    rows = table(groups[mpi_cxx.BACKEND_NAME], solo_group(groups), args)
    if COMM.rank == 0:
        print_table(rows)
        if args.json:
            args.json.write_text(json.dumps({
                "command": " ".join(sys.argv), "world_size": COMM.size,
                "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                "torch": torch.__version__, "load_average": os.getloadavg(),
                "layers": rows,
            }, indent=2) + "\n")
            plots.if_possible(args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
