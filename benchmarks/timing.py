"""Timing that several ranks agree on, for the MPI benchmarks: each call counted as long as its
slowest rank took, contenders taking turns in rounds so that load from other processes falls
on all of them alike."""

from __future__ import annotations

import random
import time

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def sample(op, calls: int) -> np.ndarray:
    """Seconds of each of ``calls`` calls of ``op``, each the slowest rank's."""
    times = np.empty(calls)
    for i in range(calls):
        COMM.Barrier()
        start = time.perf_counter()
        op()
        times[i] = time.perf_counter() - start
    COMM.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def measure(ops: dict, args) -> dict[str, dict[str, float]]:
    """Median and best seconds per call of each op, over interleaved rounds, the ops in a new
    order each round (the same on every rank: one seed per round), so that none always runs
    right after the same other one."""
    calls = {}
    for name, op in ops.items():
        op()  # warm-up: connections, first touch of buffers
        estimate = float(np.median(sample(op, 3)))
        calls[name] = max(2, min(args.max_calls, int(args.seconds / estimate)) // args.rounds)
    times = {name: [] for name in ops}
    for round_ in range(args.rounds):
        order = list(ops)
        random.Random(round_).shuffle(order)
        for name in order:
            times[name].append(sample(ops[name], calls[name]))
    return {name: {"median": float(np.median(np.concatenate(t))),
                   "best": float(np.min(np.concatenate(t))),
                   "calls": int(sum(len(x) for x in t))} for name, t in times.items()}
