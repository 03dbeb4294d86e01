"""torch's front end as issue 37's goal weighs it: the yardsticks benchmarks/allreduce.py times
beside the compiled backend (mpi_cxx), and the goal computed from them.

The goal: mpi_cxx's ``dist.all_reduce`` minus raw mpi4py's ``MPI_Allreduce`` at most torch's
own front-end cost plus 1 us. The front end is timed as ``dist.all_reduce`` of one float on
the rank's group of one on the compiled backend (torch's Python wrapper and dispatch, the
backend's call, an MPI call with no peer), in two ways:

- ``front_end``: alone, call after call: its cost with its code and data in the caches;
- ``front_end_in_turn``: taking turns call by call with raw MPI and mpi_cxx on the size's
  buffer, as the differences are timed (``timing.paired``): its cost as a real call of the
  size meets it, right after an MPI call that has pushed its code and data out of the caches.
  From 1 MiB up that is 2-11x its cost alone (benchmarks/README.md, "The front end after
  MPI").
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from benchmarks import timing
from benchmarks.timing import COMM
from launcher.mpi import cxx as mpi_cxx


def solo_group(groups: dict) -> dist.ProcessGroup | None:
    """This rank's group of one on the compiled backend (None where it is not built)."""
    if mpi_cxx.BACKEND_NAME not in groups:
        return None
    mine, _ = dist.new_subgroups(group_size=1, backend=mpi_cxx.BACKEND_NAME)
    return mine


def one_float_call(solo: dist.ProcessGroup):
    """``dist.all_reduce`` of one float on ``solo``: torch's front end and the backend's call
    with no data and no peer."""
    one = torch.zeros(1)
    return lambda: dist.all_reduce(one, group=solo)


def yardsticks(solo: dist.ProcessGroup, buf: np.ndarray, raw_call) -> dict:
    """The ops the goal is weighed with, beside the contenders on the shared buffer ``buf``:
    the front end alone, the front end then ``raw_call`` timed as one, and MPI's non-blocking
    all_reduce polled to its end."""
    front_end = one_float_call(solo)

    def in_all():
        front_end()
        raw_call()
    return {"front_end": front_end, "raw_after_front_end": in_all,
            "raw_nonblocking": nonblocking(buf)}


def nonblocking(buf: np.ndarray, comm: MPI.Intracomm = COMM):
    """MPI's non-blocking all_reduce on ``comm`` polled with MPI_Test to its end, as the
    compiled backend drives it: the part of mpi_cxx - raw that is MPI's own (its non-blocking
    algorithm), not the backend's. mpi4py's few hundred ns per Test count in it too."""

    def run():
        request = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        while not request.Test():
            pass
    return run


def goal(ops: dict, args, before=None) -> dict:
    """Issue 37's goal at one size, from ``ops`` (``benchmarks.allreduce.allreduce_ops`` with
    the yardsticks): mpi_cxx - raw and MPI's part as medians of differences within turns
    (``timing.paired``), against the front end timed two ways: alone, call after call
    (``front_end``), and in those turns, after the others' MPI calls (``front_end_in_turn``);
    and the Python backend's time over mpi_cxx's, the median of the turns' ratios."""
    warm = timing.measure({"front_end": ops["front_end"]}, args, before)["front_end"]
    names = ("raw", "mpi_cxx", "mpi4py", "front_end", "raw_nonblocking")
    turns = timing.paired({n: ops[n] for n in names}, args, before=before)
    row = {"goal_turns": turns["raw"]["calls"],
           "mpi_cxx_minus_raw_median_us": turns["mpi_cxx"]["minus_base"] * 1e6,
           "nonblocking_minus_raw_median_us": turns["raw_nonblocking"]["minus_base"] * 1e6,
           # the goal's "at least as fast as the Python backend", > 1: faster
           "mpi_cxx_vs_mpi4py_in_turn": float(np.median(turns["mpi4py"]["times"]
                                                        / turns["mpi_cxx"]["times"]))}
    for name, stats in (("front_end", warm), ("front_end_in_turn", turns["front_end"])):
        row[f"{name}_median_us"] = stats["median"] * 1e6
        row[f"{name}_best_us"] = stats["best"] * 1e6
        row[f"{name}_goal_met"] = (row["mpi_cxx_minus_raw_median_us"]
                                   <= row[f"{name}_median_us"] + 1.0)
    return row
