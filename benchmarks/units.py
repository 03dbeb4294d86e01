"""Units the benchmark tables and plots share; a leaf (no MPI, no torch), so that host-side
code can import it without starting MPI."""

from __future__ import annotations


def human(nbytes: int) -> str:
    """A message size as the tables print it: 4 KiB ... 64 MiB."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def bus_factor(ranks: int) -> float:
    """busbw / algbw of an all_reduce (nccl-tests): the share of the data each link carries."""
    return 2 * (ranks - 1) / ranks
