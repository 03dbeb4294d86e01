"""Rendezvous ports outside the node's ephemeral range: a Slurm step's, which every rank derives
alone from the job and step ids, and a free one for a job that picks its own.

A leaf beside ``launcher.group.rendezvous``: ``launcher.placement.detectors`` reads the ids, this
module turns them into a port, and the rendezvous binds it.
"""

from __future__ import annotations

import math
import random
import socket
from pathlib import Path

#: the ports a derived rendezvous port is drawn from, less the node's ephemeral range
SLURM_PORTS = (10000, 65535)
#: where Linux keeps the ephemeral range, and its default where that cannot be read
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports this node hands to outgoing connections (``net.ipv4.ip_local_port_range``)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return low, high


def slurm_port(job_id: str, step_id: str | None,
               ephemeral: tuple[int, int] | None = None) -> int:
    """A rendezvous port every rank of a step computes alone, distinct per (job, step).

    Drawn from 10000-65535 without the node's ephemeral range (read from /proc unless given),
    where any outgoing connection on the node may hold a port already. Steps of one job never
    share a port (the stride between steps is coprime with the number of ports); jobs with the
    same step id share one only if their ids differ by a multiple of that number (27304 ports
    with Linux's default range: 10000-32767, 61000-65535). Non-numeric ids (array tasks such as
    ``123_4``) use their digits. Every node of a job must have the same ephemeral range
    (sysctl), as clusters do.
    """
    windows = _windows(ephemeral)
    span = sum(b - a + 1 for a, b in windows)
    job = int("".join(c for c in job_id if c.isdigit()) or 0)
    step = int(step_id) if step_id is not None and step_id.strip().isdigit() else 0
    return _nth(windows, (job + _step_stride(span) * step) % span)


def ephemeral_warning(port: int, ephemeral: tuple[int, int] | None = None) -> str | None:
    """The line for a rendezvous port given inside the node's ephemeral range (read from /proc
    unless given), where rank 0's bind fails whenever an outgoing connection holds the port:
    at random, so it is said before it happens. None outside the range."""
    low, high = ephemeral or ephemeral_range()
    if not low <= port <= high:
        return None
    return (f"MASTER_PORT={port} lies in this node's ephemeral range ({low}-{high}), from which "
            "the kernel gives ports to outgoing connections: when one holds it, rank 0 cannot "
            f"start the rendezvous (\"address already in use\"); choose a port below {low} "
            "(29500, say), or unset MASTER_PORT and the launcher picks one")


def free_port(ephemeral: tuple[int, int] | None = None, tries: int = 50) -> int:
    """A TCP port nothing holds right now, drawn at random from the ports ``slurm_port`` draws
    from. Not the kernel's pick (bind to port 0): that comes from the ephemeral range, where
    other programs' own picks and outgoing connections take theirs, so a port picked there and
    bound a moment later was sometimes taken in between (jobs started side by side in CI)."""
    windows = _windows(ephemeral)
    span = sum(b - a + 1 for a, b in windows)
    for _ in range(tries):
        port = _nth(windows, random.randrange(span))
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # all tried were taken: the kernel's pick after all
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _windows(ephemeral: tuple[int, int] | None) -> list[tuple[int, int]]:
    """SLURM_PORTS without the ephemeral range (read from /proc unless given)."""
    low, high = ephemeral or ephemeral_range()
    first, last = SLURM_PORTS
    windows = [(first, min(last, low - 1)), (max(first, high + 1), last)]
    return [(a, b) for a, b in windows if a <= b] or [SLURM_PORTS]


def _nth(windows: list[tuple[int, int]], index: int) -> int:
    for a, b in windows:
        if index <= b - a:
            return a + index
        index -= b - a + 1
    raise AssertionError("unreachable: index < span")


def _step_stride(span: int) -> int:
    """About span / golden ratio, coprime with span: step k of a job lands far from step 0 of
    jobs with nearby ids, and no two steps of one job meet."""
    stride = max(1, round(span / 1.618))
    while math.gcd(stride, span) != 1:
        stride -= 1
    return stride
