"""The 4-byte ping-pong of benchmarks/allreduce.py, between ranks 0 and 1, through each
contender: ``dist.send``/``dist.recv`` on each backend's group, the compiled backend's
``ProcessGroup`` called directly (``mpi_cxx_pg``) and raw mpi4py ``Send``/``Recv``; timed as
OSU's osu_latency does (round trips back to back after a barrier, their mean per round, rounds
taken in turns). Issue 37's goal: the compiled backend within 2x raw, weighed on its
``ProcessGroup``'s send/recv: torch's Python ``dist.send``/``dist.recv`` alone costs about as
much as raw MPI's round trip, so that through them a backend that added nothing would be at
about 2x already (``print_latency`` shows where).

Ratios are medians over rounds of each round's ratio: a round's contenders run within a
fraction of a second of each other, on a VM whose speed changes by 4x from second to second
(benchmarks/README.md)."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.timing import COMM, round_order
from launcher.mpi import cxx as mpi_cxx

#: round trips timed together per round, and rounds at least
PINGPONG_TRIPS = 2000
PINGPONG_ROUNDS = 10


def pingpong_ops(groups) -> dict:
    """A 4-byte round trip between ranks 0 and 1 per contender (other ranks idle)."""
    me = COMM.rank
    raw = np.zeros(1, dtype=np.float32)

    def over(group):
        tensor = torch.zeros(1)

        def run():
            if me == 0:
                dist.send(tensor, 1, group=group)
                dist.recv(tensor, 1, group=group)
            elif me == 1:
                dist.recv(tensor, 0, group=group)
                dist.send(tensor, 0, group=group)
        return run

    def raw_run():
        if me == 0:
            COMM.Send(raw, dest=1)
            COMM.Recv(raw, source=1)
        elif me == 1:
            COMM.Recv(raw, source=0)
            COMM.Send(raw, dest=0)

    def direct(group):  # torch's Python dist.send/recv skipped: what the backend itself costs
        tensor = torch.zeros(1)

        def run():
            if me == 0:
                group.send([tensor], 1, 0).wait()
                group.recv([tensor], 1, 0).wait()
            elif me == 1:
                group.recv([tensor], 0, 0).wait()
                group.send([tensor], 0, 0).wait()
        return run

    extra = ({"mpi_cxx_pg": direct(groups[mpi_cxx.BACKEND_NAME])}
             if mpi_cxx.BACKEND_NAME in groups else {})
    return {**{name: over(g) for name, g in groups.items()}, **extra, "raw": raw_run}


def pingpong(ops: dict, rounds: int, trips: int = PINGPONG_TRIPS) -> dict[str, dict[str, float]]:
    """Seconds per round trip of each op, as OSU's osu_latency times them: ``trips`` back to
    back after a barrier, their mean per round; median and best over rounds taken in turns, in
    a new order each round."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for round_ in range(rounds):
        for name in round_order(ops, round_):
            op = ops[name]
            for _ in range(PINGPONG_TRIPS // 10):  # warm-up
                op()
            COMM.Barrier()
            start = time.perf_counter()
            for _ in range(trips):
                op()
            times[name].append(COMM.bcast((time.perf_counter() - start) / trips, root=0))
    raw = np.array(times["raw"])
    return {name: {"median": float(np.median(t)), "best": float(np.min(t)),
                   "vs_raw": float(np.median(np.array(t) / raw))}
            for name, t in times.items()}


def print_latency(latency: dict) -> None:
    print(f"\nping-pong, 4 bytes, half round trip ({PINGPONG_TRIPS} back to back per round), "
          "median (best) us: "
          + ", ".join(f"{n} {latency[n]['median'] / 2 * 1e6:.2f} "
                      f"({latency[n]['best'] / 2 * 1e6:.2f})" for n in latency)
          + " (mpi_cxx_pg: its ProcessGroup's send/recv called directly, without torch's "
          "Python dist.send/recv)")
    if "mpi_cxx" in latency:
        cxx, pg = latency["mpi_cxx"]["vs_raw"], latency["mpi_cxx_pg"]["vs_raw"]
        wrapper = cxx - pg
        print(f"/ raw (the median of the rounds' ratios): mpi_cxx {cxx:.2f}, its ProcessGroup "
              f"{pg:.2f} (goal <= 2); torch's Python dist.send/recv alone (mpi_cxx - its "
              f"ProcessGroup) {wrapper:.2f}: through them a backend that added nothing would be "
              f"at {1 + wrapper:.2f}")
