"""all_reduce and point-to-point latency: the compiled mpi backend (mpi_cxx, where it is built)
vs the Python one (mpi4py) vs gloo vs raw mpi4py, one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.allreduce \
        --json benchmarks/results/allreduce.json

Every rank takes part; rank 0 prints the table and writes the JSON. Sizes are float32 buffers
from 4 KiB to 64 MiB. Each call is timed on its own, after a barrier, and counts as long as
its slowest rank took; the three contenders take turns in several rounds so that load from
other processes falls on all of them alike. The table shows the median call and, beside it,
the best call: on a busy machine the best is the steadier estimate of what the code costs.
Bandwidth is algorithm bandwidth (bytes reduced per second of one all_reduce) and bus
bandwidth as nccl-tests define it, busbw = algbw x 2(n-1)/n: what each rank's link carries in a
ring all_reduce, comparable with the link itself.

The physical floor, measured in the same run: the link's one-way bandwidth (the best half round
trip of a 64 MiB raw MPI ping-pong between ranks 0 and 1: shared memory on one node, the network
across nodes) and one core's memory copy bandwidth (numpy, 64 MiB). No all_reduce of S bytes
over n ranks can take less than 2(n-1)/n x S / link; "vs link" = busbw / link, 1.0 at the floor.
Beside it, the bandwidth each rank gets while ALL ranks send 64 MiB to the next rank and receive
from the previous one at once ("exchange", the step of a ring all_reduce): on a real network,
where each node has its own NIC, full duplex, and its own cores, it equals the link; where the
ranks share cores (containers on one VM) it is what the machine can carry for any contender,
gloo included, and "vs exch" = busbw / exchange says how close each comes to that.

Ping-pong (4 bytes between ranks 0 and 1, ``benchmarks/pingpong.py``) is timed as OSU's
osu_latency does: round trips back to back after a barrier, their mean per round, rounds taken
in turns.

A second table times the all_reduce as training meets it: the ranks compute between calls
(float32 matrix products on one torch thread each, about a CNN step's worth: 20 units on
rank 0 and 4 more on each further rank, so that they arrive at different times, as when one
rank's step is slower), and the cost counted is the time from the LAST rank's arrival to the
end of the call. That is the call time of the rank that arrived last, i.e. the smallest call
time over the ranks: no clocks need to agree across nodes. It shows what a backend that moves
data on helper threads (gloo) pays when the ranks keep their cores busy, which the idle
ping-pong above cannot show.

Where the compiled backend is built, each size also weighs issue 37's goal
(``benchmarks/front_end.py``): mpi_cxx - raw, as the median of differences of calls that take
turns call by call (``timing.paired``: this VM changes speed by 4x from second to second),
against torch's front end on each rank's group of one, timed alone and in those turns; and
MPI's non-blocking all_reduce polled to its end ("MPI's part"): how much of mpi_cxx - raw the
backend cannot help, since it must call the non-blocking one to keep its
timeouts. ``--evict-mib 64`` times the sizes' table with every call, the front end's too,
started cold, as after compute (benchmarks/README.md, "With the caches evicted").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from benchmarks import allreduce_report, front_end, pingpong, plots, rank_side, timing
from benchmarks.floor import floor
from benchmarks.timing import COMM, measure
from benchmarks.units import bus_factor
from launcher.mpi import backend as mpi_backend
from launcher.mpi import cxx as mpi_cxx
from launcher.mpi import segments as mpi_segments
from launcher.training.models import cnn  # noqa: E402

SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
#: the gradients of the CNN: the all_reduce of each step of the weak-scaling benchmark
# counted on the meta device, not allocated: a benchmark that imports this module can still set
# torch's allocator variables, read at its first allocation (huge_pages.py)
with torch.device("meta"):
    BUSY_BYTES = 4 * sum(p.numel() for p in cnn().parameters())
#: one unit of compute between busy calls: a 256 x 256 matrix product, ~0.4 ms on one core
BUSY_UNIT = 256


def parse_args() -> argparse.Namespace:
    parser = timing.parser(__doc__, rounds=8, seconds=0.8, max_calls=2000)
    parser.add_argument("--busy-calls", type=int, default=400,
                        help="calls of the all_reduce between rounds of compute")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="before each timed all_reduce of the sizes' table, write this many "
                        "MiB of other memory on every rank, untimed, so that each call starts "
                        "with the caches as compute leaves them (0: off)")
    return parser.parse_args()


def init_groups() -> dict[str, dist.ProcessGroup]:
    """gloo as the default group (rank 0's store on a port the kernel picks as it binds, sent
    over MPI), the mpi backends beside it: the compiled one where it is built, and the Python
    one. Nothing is left in /dev/shm however the job ends (``launcher.mpi.segments``)."""
    mpi_segments.unlink_mapped(COMM)
    timeout = datetime.timedelta(minutes=5)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(host, 0, COMM.size, is_master=True, timeout=timeout,
                          wait_for_workers=False) if COMM.rank == 0 else None
    port = COMM.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(host, port, COMM.size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=COMM.rank, world_size=COMM.size,
                            timeout=timeout)
    groups = {}
    if mpi_cxx.choose().name == mpi_cxx.BACKEND_NAME:
        groups[mpi_cxx.BACKEND_NAME] = dist.new_group(backend=mpi_cxx.BACKEND_NAME,
                                                      timeout=timeout)
    groups["mpi4py"] = dist.new_group(backend=mpi_backend.register(), timeout=timeout)
    groups["gloo"] = dist.group.WORLD
    return groups


def contenders(groups: dict) -> tuple[str, ...]:
    """The backends init_groups made (mpi_cxx only where it is built), then raw."""
    return (*groups, "raw")


def allreduce_ops(nbytes: int, groups: dict, solo: dist.ProcessGroup | None = None) -> dict:
    """One all_reduce of ``nbytes`` per contender, and on ``solo`` as "front_end" where given,
    all on one buffer of zeros (sums stay finite however often they run). One buffer, since
    where it lies counts: three buffers of 4 MiB in one process took 556, 544 and 543 us for
    the same raw all_reduce, each the same in four rounds (this VM, 2026-12-03), as much as
    the differences between contenders that the goal weighs."""
    buf = torch.zeros(nbytes // 4)

    def over(group):
        return lambda: dist.all_reduce(buf, group=group)

    raw = buf.numpy()

    def raw_call():
        COMM.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)

    extra = {} if solo is None else front_end.yardsticks(solo, raw, raw_call)
    return {**{name: over(g) for name, g in groups.items()}, "raw": raw_call, **extra}


def allreduce_table(groups, args, limits: dict[str, float],
                    solo: dist.ProcessGroup | None = None) -> list[dict]:
    link_GBps = limits["link_GBps"]
    rows = []
    before = timing.evictor(args.evict_mib)
    for nbytes in SIZES:
        ops = allreduce_ops(nbytes, groups, solo)
        stats = measure({name: ops[name] for name in contenders(groups)}, args, before)
        row = {"bytes": nbytes,
               "floor_us": bus_factor(COMM.size) * nbytes / link_GBps / 1e3}
        for name in contenders(groups):
            for stat in ("median", "best"):
                row[f"{name}_{stat}_us"] = stats[name][stat] * 1e6
                row[f"{name}_{stat}_GBps"] = nbytes / stats[name][stat] / 1e9
                row[f"{name}_{stat}_busGBps"] = row[f"{name}_{stat}_GBps"] * bus_factor(
                    COMM.size)
                row[f"{name}_vs_link_{stat}"] = row[f"{name}_{stat}_busGBps"] / link_GBps
                row[f"{name}_vs_exchange_{stat}"] = (row[f"{name}_{stat}_busGBps"]
                                                     / limits["exchange_GBps"])
            row[f"{name}_calls"] = stats[name]["calls"]
        for stat in ("median", "best"):
            mine = stats["mpi4py"][stat]
            row[f"vs_raw_{stat}"] = stats["raw"][stat] / mine  # 1.0: as fast as raw mpi4py
            row[f"vs_gloo_{stat}"] = stats["gloo"][stat] / mine  # > 1: faster than gloo
            if "mpi_cxx" in stats:
                cxx = stats["mpi_cxx"][stat]
                row[f"mpi_cxx_vs_raw_{stat}"] = stats["raw"][stat] / cxx
                row[f"mpi_cxx_vs_mpi4py_{stat}"] = mine / cxx  # > 1: faster than Python's
        if solo is not None:
            row.update(front_end.goal(ops, args, before))
        rows.append(row)
    return rows


def busy_allreduce(groups, args, solo=None) -> dict[str, dict[str, float]]:
    """Latency after the last rank's arrival of an all_reduce between rounds of compute; with
    ``solo`` also what each layer costs alone with the caches cold from the compute:
    ``front_end`` (dist.all_reduce on a group of one: torch and the compiled backend),
    ``raw_nonblocking`` (allreduce_ops') and ``raw_self`` (MPI's all_reduce on one rank); and
    ``mpi_cxx_warmed``: the compiled backend's call after an untimed all_reduce of one float on
    the group of one, which brings the code path both take back into the caches."""
    torch.set_num_threads(1)  # one core per rank, as benchmarks/train_scaling.py runs them
    a = torch.randn(BUSY_UNIT, BUSY_UNIT)
    units = 20 + 4 * COMM.rank
    ops = allreduce_ops(BUSY_BYTES, groups, solo)
    before = {}  # untimed, after the compute: only the warmed row has one
    if solo is not None:
        alone = np.zeros(BUSY_BYTES // 4, np.float32)
        ops["raw_self"] = lambda: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, alone, op=MPI.SUM)
        if "mpi_cxx" in ops:
            ops["mpi_cxx_warmed"] = ops["mpi_cxx"]
            before["mpi_cxx_warmed"] = front_end.one_float_call(solo)
    result = {}
    for name, op in ops.items():
        times = np.empty(args.busy_calls)
        COMM.Barrier()
        for i in range(args.busy_calls):
            for _ in range(units):
                a @ a
            if name in before:
                before[name]()
            start = time.perf_counter()
            op()
            times[i] = time.perf_counter() - start
        COMM.Allreduce(MPI.IN_PLACE, times, op=MPI.MIN)
        times = times[args.busy_calls // 10:]  # warm-up
        # the mean is what a training step pays on average; the tail is where gloo loses
        result[name] = {"mean": float(np.mean(times)), "median": float(np.median(times)),
                        "p90": float(np.quantile(times, 0.9)), "best": float(np.min(times))}
    return result


def main() -> None:
    args = parse_args()
    rank_side.end_job_on_error()
    groups = init_groups()
    solo = front_end.solo_group(groups)
    limits = floor(args)
    rows = allreduce_table(groups, args, limits, solo)
    latency = pingpong.pingpong(pingpong.pingpong_ops(groups),
                                max(args.rounds, pingpong.PINGPONG_ROUNDS))
    busy = busy_allreduce(groups, args, solo)
    hosts = COMM.gather(socket.gethostname())
    if COMM.rank == 0:
        if args.evict_mib:
            print(f"each all_reduce of the sizes' table after {args.evict_mib} MiB of other "
                  "memory written on every rank (--evict-mib)")
        allreduce_report.print_table(rows, contenders(groups), limits)
        pingpong.print_latency(latency)
        allreduce_report.print_busy(busy, BUSY_BYTES)
        if args.json:
            args.json.write_text(json.dumps({
                "command": " ".join(sys.argv),
                "world_size": COMM.size,
                "nodes": len(set(hosts)),
                "floor": limits,
                "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                "mpi4py_thread_level": MPI.Query_thread(),
                "torch": torch.__version__,
                "load_average": os.getloadavg(),
                "evict_mib": args.evict_mib,
                "allreduce": rows,
                "pingpong_half_round_trip_us": {
                    n: {k: latency[n][k] / 2 * 1e6 for k in ("median", "best")}
                    for n in latency},
                "pingpong_vs_raw": {n: latency[n]["vs_raw"] for n in latency},
                "busy_allreduce_bytes": BUSY_BYTES,
                "busy_allreduce_after_last_arrival_us": {
                    n: {k: v * 1e6 for k, v in stats.items()} for n, stats in busy.items()},
            }, indent=2) + "\n")
            plots.if_possible(args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
