"""One all_reduce through each layer between torch's ``dist.all_reduce`` and MPI, on the
compiled backend, in one run: where issue 37's 1-4 MiB gap over raw MPI lies.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.allreduce_layers \
        --json benchmarks/results/allreduce_layers.json

The layers, all on one buffer (where a buffer lies counts as much as the gap,
benchmarks/README.md) and taking turns call by call (``timing.paired``: each layer's time
minus raw's is the median of the differences within turns, on a VM that changes speed by 4x
from second to second):

- ``raw``: ``MPI_Allreduce`` on ``COMM_WORLD`` (mpi4py), the floor the goal measures against;
- ``nonblocking``: ``MPI_Iallreduce`` on a duplicate of it, polled with ``MPI_Test`` from
  Python: the MPI calls the backend makes, on the kind of communicator it has;
- ``backend``: the compiled ``c10d::Backend`` called directly (``asyncOp`` false: run in the
  caller's thread, as ``dist.all_reduce`` runs it), no torch dispatcher and no front end;
- ``process_group``: the same through the group's ``ProcessGroup`` (torch's dispatcher);
- ``dist``: ``dist.all_reduce`` on the group, what users call.

Each layer's time minus the one below it is what that layer adds. Beside them, the goal's
yardstick, torch's front end (``dist.all_reduce`` of one float on the group of one), timed
alone call after call (``front_end``: its code and data in the caches) and in the turns
(``front_end_in_turn``: right after the others' MPI calls of the size, as a real call meets
it): what an MPI call does to the front end after it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from benchmarks import plots, rank_side, timing
from benchmarks.allreduce import init_groups
from benchmarks.front_end import nonblocking, one_float_call, solo_group
from benchmarks.timing import COMM
from benchmarks.units import human
from launcher.mpi import cxx as mpi_cxx

KiB = 1 << 10
SIZES = (16 * KiB, 256 * KiB, 1024 * KiB, 4096 * KiB)
LAYERS = ("raw", "nonblocking", "backend", "process_group", "dist")
FRONT_END = ("front_end", "front_end_in_turn")


def parse_args():
    parser = timing.parser(__doc__, rounds=6, seconds=3.0, max_calls=1000, per="size")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) * KiB for x in s.split(",")),
                        default=SIZES, help="sizes in KiB, comma-separated")
    return parser.parse_args()


def layer_ops(nbytes: int, group: dist.ProcessGroup, solo: dist.ProcessGroup,
              dup: MPI.Intracomm) -> dict:
    """The layers' calls and the front end's, on one buffer of zeros (sums stay finite)."""
    t = torch.zeros(nbytes // 4)
    buf = t.numpy()
    backend = group._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # its default (true) hands the op to the progress thread
    return {"raw": lambda: COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            "nonblocking": nonblocking(buf, dup),
            "backend": lambda: backend.allreduce([t], opts).wait(),
            "process_group": lambda: group.allreduce([t], opts).wait(),
            "dist": lambda: dist.all_reduce(t, group=group),
            "front_end_in_turn": one_float_call(solo)}


def table(group, solo, args) -> list[dict]:
    dup = COMM.Dup()
    rows = []
    for nbytes in args.sizes:
        ops = layer_ops(nbytes, group, solo, dup)
        stats = timing.paired(ops, args)
        stats["front_end"] = timing.measure({"front_end": ops["front_end_in_turn"]},
                                            args)["front_end"]
        row = {"bytes": nbytes, "turns": stats["raw"]["calls"]}
        for name, stat in stats.items():
            for kind in ("median", "best"):
                row[f"{name}_{kind}_us"] = stat[kind] * 1e6
            if name not in FRONT_END:  # the yardstick, not a layer above raw
                row[f"{name}_minus_raw_median_us"] = stat["minus_base"] * 1e6
        rows.append(row)
    dup.Free()
    return rows


def print_table(rows: list[dict]) -> None:
    names = (*LAYERS, *FRONT_END)
    print(f"all_reduce float32, {COMM.size} ranks, each layer's time minus raw MPI's: the median "
          f"of the differences within turns, us; raw and the front end: their own times, "
          f"median (best)")
    print(f"{'size':>8} " + " ".join(f"{n:>19}" for n in names))
    for row in rows:
        cells = [f"{row[f'{n}_median_us']:8.1f} ({row[f'{n}_best_us']:7.1f})"
                 if n == "raw" or n in FRONT_END else f"{row[f'{n}_minus_raw_median_us']:8.1f}"
                 for n in names]
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
