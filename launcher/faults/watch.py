"""Who watches whom: a pure function of the world size and each rank's node.

Each rank beats to ``WATCHERS`` (2) ranks and listens to the ranks that chose it, so the
heartbeats cost O(1) messages per rank per second however large the job, and no rank serves
more than its share. The ranks are laid out node by node (``order``); rank at position ``i`` is
watched by the ranks at positions ``i + s`` for two shifts ``s`` chosen so that a rank and its
two watchers lie on three different nodes (``shifts``): a node lost together with one watcher
of its ranks still leaves the other one to tell. Both shifts are the same for every rank, so
every rank watches exactly two and is watched by exactly two.

That needs no node to hold more than a third of the ranks. Where one does (two nodes, or one
big node beside small ones), each rank is watched by two ranks of the other nodes spread
evenly over them (``_lopsided``): still on other nodes, not always on two different ones, and
a rank of a small node watches more ranks of the big one (no fewer will do).

On a single node the watchers are the next two ranks: there is no other node to be on.

Silence a watcher finds is told to every rank over the side channel
(``launcher.faults.heartbeat``), so every survivor names every silent rank, not only those it
watches. docs/training.md ("The control plane at scale") says why this design (a fixed
ring-like graph, as Open MPI's ULFM detector) and not gossip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: how many ranks watch each rank
WATCHERS = 2


@dataclass(frozen=True)
class Watch:
    """One rank's part of the topology."""

    #: the ranks this rank beats to
    watchers: tuple[int, ...]
    #: the ranks this rank listens to
    watched: tuple[int, ...]


def order(nodes: Sequence[str]) -> list[int]:
    """The ranks node by node (nodes in order of their first rank), each node's by rank."""
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return sorted(range(len(nodes)), key=lambda rank: (first[nodes[rank]], rank))


def shifts(world_size: int, biggest_node: int) -> tuple[int, ...] | None:
    """Two shifts that put a position and its two watchers at least ``biggest_node`` apart
    around the circle (so on three different nodes); None when no such pair exists."""
    if 3 * biggest_node > world_size:
        return None
    first = world_size // 3
    return first, first + (world_size - first) // 2


def watchers_of(nodes: Sequence[str]) -> list[tuple[int, ...]]:
    """For every rank, the ranks that watch it (``nodes[rank]`` is its node)."""
    size = len(nodes)
    if size <= 1:
        return [()] * size
    laid = order(nodes)
    counts: dict[str, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    result: list[tuple[int, ...]] = [()] * size
    if len(counts) == 1:
        steps = range(1, min(WATCHERS, size - 1) + 1)
        for position, rank in enumerate(laid):
            result[rank] = tuple(laid[(position + step) % size] for step in steps)
        return result
    pair = shifts(size, max(counts.values()))
    if pair is None:
        return _lopsided(nodes, laid, counts)
    for position, rank in enumerate(laid):
        result[rank] = tuple(laid[(position + shift) % size] for shift in pair)
    return result


def _lopsided(nodes: Sequence[str], laid: list[int],
              counts: dict[str, int]) -> list[tuple[int, ...]]:
    """Watchers where one node holds over a third of the ranks: for the ``j``-th rank of a
    node of ``z`` ranks, two ranks of the other ``r`` ranks (in layout order, starting after
    its node), ``j * r // z`` and half the others further on."""
    size = len(laid)
    result: list[tuple[int, ...]] = [()] * size
    start = 0
    while start < size:
        node = nodes[laid[start]]
        own = counts[node]
        others = size - own
        for local in range(own):
            first = local * others // own
            picks = dict.fromkeys(
                laid[(start + own + (first + step) % others) % size]
                for step in range(0, others, max(1, others // WATCHERS))[:WATCHERS])
            result[laid[start + local]] = tuple(picks)
        start += own
    return result


def watch(nodes: Sequence[str], rank: int) -> Watch:
    """``rank``'s watchers and the ranks it watches."""
    of = watchers_of(nodes)
    return Watch(watchers=of[rank],
                 watched=tuple(other for other, by in enumerate(of) if rank in by))
