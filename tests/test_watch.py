"""Who watches whom (``launcher.faults.watch``): its promises at every size, 1 ... 100,000.

Each layout is a list of node names, one per rank, as a launcher places them: blocks of equal
nodes, round-robin, lopsided (one big node beside small ones), two nodes, one node, one rank
per node. The promises: every rank has at most a few watchers and watches at most a few ranks
(O(1), bounded by the ratio of node sizes where nodes differ); every rank is watched by two
ranks on other nodes where the other nodes hold two ranks, and on two different other nodes
where no node holds over a third of the ranks; nobody watches itself.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from launcher.faults import side_channel, watch

SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 63, 64, 100, 256, 1000, 1024, 4096, 10_000, 100_000]


def blocks(size: int, per_node: int) -> list[str]:
    return [f"n{rank // per_node}" for rank in range(size)]


def round_robin(size: int, nodes: int) -> list[str]:
    return [f"n{rank % nodes}" for rank in range(size)]


def lopsided(size: int) -> list[str]:
    big = max(1, size // 2)
    return ["big"] * big + [f"small{rank % 3}" for rank in range(size - big)]


LAYOUTS = {
    "one-node": lambda size: ["n0"] * size,
    "8-per-node": lambda size: blocks(size, 8),
    "4-per-node-round-robin": lambda size: round_robin(size, max(1, size // 4)),
    "one-per-node": lambda size: blocks(size, 1),
    "two-nodes": lambda size: blocks(size, max(1, (size + 1) // 2)),
    "lopsided": lopsided,
}


def _check(nodes: list[str]) -> None:
    size = len(nodes)
    of = watch.watchers_of(nodes)
    assert len(of) == size
    load = Counter(watcher for watchers in of for watcher in watchers)
    counts = Counter(nodes)
    # the most any rank can be asked to watch: the biggest node's ranks spread over the others
    # (none more where no node holds over a third), and a little for the smaller nodes
    biggest = max(counts.values())
    bound = watch.WATCHERS * (-(-biggest // max(1, size - biggest)) + 2)
    assert max(load.values(), default=0) <= bound
    spread = watch.shifts(size, biggest) is not None and len(counts) > 1
    if spread:  # the same two shifts for all: everyone watches exactly as many
        assert set(load.values()) == {watch.WATCHERS}
    for rank, watchers in enumerate(of):
        assert rank not in watchers and len(set(watchers)) == len(watchers)
        assert len(watchers) <= watch.WATCHERS
        elsewhere = [w for w in watchers if nodes[w] != nodes[rank]]
        others = size - counts[nodes[rank]]
        if others:
            assert len(elsewhere) >= min(2, others), (rank, watchers)
        else:
            assert len(watchers) == min(watch.WATCHERS, size - 1)
        if spread:
            assert len({nodes[w] for w in watchers} | {nodes[rank]}) == 3, (rank, watchers)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size", SIZES)
def test_the_topology_keeps_its_promises(layout, size):
    _check(LAYOUTS[layout](size))


def test_a_shuffled_placement_keeps_them_too():
    nodes = blocks(4096, 8)
    random.Random(7).shuffle(nodes)
    _check(nodes)


def test_watch_lists_are_each_others_mirror():
    nodes = blocks(64, 8)
    of = watch.watchers_of(nodes)
    for rank in range(64):
        mine = watch.watch(nodes, rank)
        assert mine.watchers == of[rank]
        assert all(rank in of[watched] for watched in mine.watched)
        assert len(mine.watched) == watch.WATCHERS


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 1000, 10_000])
def test_a_broadcast_reaches_every_rank_in_log_hops_past_one_stopped_rank(size):
    """The MPI side channel's two trees: every rank in at most ceil(log2 N) hops, and with one
    rank stopped (it passes nothing on) every other rank still, within twice that."""
    for origin in {0, size // 2, size - 1}:
        for stopped in {None, (origin + 1) % size, (origin + size // 2) % size} - {origin}:
            hops = {origin: 0}
            frontier = [origin]
            while frontier:
                passing = [r for r in frontier if r != stopped]
                frontier = []
                for rank in passing:
                    for peer in side_channel.forwards(rank, origin, size):
                        if peer not in hops:
                            hops[peer] = hops[rank] + 1
                            frontier.append(peer)
            reached = set(hops) - ({stopped} if stopped is not None else set())
            assert reached == set(range(size)) - {stopped}
            limit = max(1, (size - 1).bit_length())
            assert max(hops.values()) <= (limit if stopped is None else 2 * limit)
