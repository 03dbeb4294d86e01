"""Timing that several ranks agree on, for the MPI benchmarks: each call counted as long as its
slowest rank took, contenders taking turns in rounds so that load from other processes falls
on all of them alike."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def parser(doc: str, rounds: int, seconds: float, max_calls: int, per: str = "size and contender",
           calls: str = "calls per size") -> argparse.ArgumentParser:
    """The command line of a benchmark timed by ``measure``, which reads its ``--rounds``,
    ``--seconds`` and ``--max-calls``, with these defaults; ``per``: what the time budget is
    for, ``calls``: what ``--max-calls`` counts."""
    made = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    made.add_argument("--json", type=Path, help="write the results here (rank 0)")
    made.add_argument("--rounds", type=int, default=rounds, help="turns each contender takes")
    made.add_argument("--seconds", type=float, default=seconds,
                      help=f"time budget per {per}, all rounds together")
    made.add_argument("--max-calls", type=int, default=max_calls, help=f"{calls} at most")
    return made


def sample(op, calls: int, before=None) -> np.ndarray:
    """Seconds of each of ``calls`` calls of ``op``, each the slowest rank's; ``before``, where
    given, runs untimed before each call's barrier."""
    times = np.array([timed(op, before) for _ in range(calls)])
    COMM.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def timed(op, before=None) -> float:
    """Seconds of one call of ``op`` on this rank, started after a barrier; ``before``, where
    given, runs untimed before the barrier."""
    if before is not None:
        before()
    COMM.Barrier()
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def round_order(ops: dict, round_: int) -> list[str]:
    """The ops' names in round ``round_``'s order: shuffled, the same on every rank (one seed
    per round), so that no op always runs right after the same other one."""
    order = list(ops)
    random.Random(round_).shuffle(order)
    return order


def measure(ops: dict, args, before=None) -> dict[str, dict[str, float]]:
    """Median and best seconds per call of each op, over interleaved rounds, the ops in a new
    order each round (``round_order``); ``before``: ``sample``'s."""
    calls = {}
    for name, op in ops.items():
        op()  # warm-up: connections, first touch of buffers
        estimate = float(np.median(sample(op, 3, before)))
        calls[name] = max(2, min(args.max_calls, int(args.seconds / estimate)) // args.rounds)
    times = {name: [] for name in ops}
    for round_ in range(args.rounds):
        for name in round_order(ops, round_):
            times[name].append(sample(ops[name], calls[name], before))
    return {name: {"median": float(np.median(np.concatenate(t))),
                   "best": float(np.min(np.concatenate(t))),
                   "calls": int(sum(len(x) for x in t))} for name, t in times.items()}


def paired(ops: dict, args, base: str = "raw", before=None) -> dict[str, dict]:
    """Each op's median and best seconds, its median difference to ``base``'s call of the same
    turn (``minus_base``) and its seconds turn by turn (``times``, for other pairs). The ops
    take turns call by call, in a new order each turn (``round_order``), so that the calls of
    one turn lie within a few milliseconds and see the machine alike. On a VM whose speed
    changes by 4x from one second to the next (1 MiB raw all_reduce 135 us, then 550-700, then
    135 again; benchmarks/README.md), the difference of two medians over rounds is as wide as
    that; the median of the turns' differences is not. Each op runs after another op of the
    turn, never after itself: it meets the caches as those leave them."""
    for op in ops.values():
        op()  # warm-up: connections, first touch of buffers
    turn = sum(float(np.median(sample(op, 3, before))) for op in ops.values())
    turns = max(5, min(args.max_calls, int(args.seconds / turn)))
    times = {name: np.empty(turns) for name in ops}
    for i in range(turns):
        for name in round_order(ops, i):
            times[name][i] = timed(ops[name], before)
    for t in times.values():
        COMM.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return {name: {"median": float(np.median(t)), "best": float(np.min(t)), "calls": turns,
                   "minus_base": float(np.median(t - times[base])), "times": t}
            for name, t in times.items()}


def evictor(mib: int):
    """What ``benchmarks.allreduce --evict-mib`` runs before each call: one pass of writes over
    ``mib`` MiB of this rank's own memory (None for 0). Twice the last-level cache (32 MiB on
    this VM) evicts the buffers and MPI's and torch's code and data alike."""
    if mib <= 0:
        return None
    other = np.zeros((mib << 20) // 4, np.float32)

    def run():
        np.add(other, 1.0, out=other)
    return run
