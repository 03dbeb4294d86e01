"""``python -m launcher.check --preflight``: find the node that would slow the whole job.

A synchronous job runs at the pace of its slowest rank, so one node with a throttled CPU, a
failing DIMM or a bad link costs every step. In a few seconds every rank measures its compute
(a GEMM, GFLOP/s) and memory bandwidth (a copy, GB/s) while all ranks do the same, as they
would in training; then the first ranks of pairs of nodes bounce a message over the job's
backend (GB/s), in at most ``MAX_ROUNDS`` rounds whatever the number of nodes
(``link_rounds``). Rank 0 prints one table and names each node far below the others.

Far below: under ``SLOW_FRACTION`` (0.5) times the median of the nodes, on any one figure. The
job would run at half speed or worse because of that node alone, while healthy nodes of one
kind differ by far less (clock boost, temperature: 10-20 %). The median, not the mean, so
that one slow node does not lower the bar it is measured against. Links are judged per node
(the median of its links) from 3 nodes on: with two, one slow link cannot be pinned on
either end.

Which links: each node's to its two neighbours in a ring of the nodes, and to one more
partner drawn by a shuffle that every rank draws alike: 3 links per node from 4 nodes on
(the ring's 2 when the shuffle draws a neighbour), enough for a median that one slow
neighbour cannot move. The ring's links form 2 rounds of disjoint pairs (3 for an odd
number of nodes), the shuffle's one more; within a round all pairs measure at once, as the
links would carry a training's traffic. Measuring every pair would take O(nodes) rounds:
at 1,000 nodes, minutes instead of a second.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.core.atomic import write_atomic
from launcher.core.errors import LaunchError
from launcher.diagnostics.rank_report import gather
from launcher.group.process_group import process_group
from launcher.placement.env import JobEnv

#: a node below this fraction of the nodes' median on any figure is named
SLOW_FRACTION = 0.5
#: how long each measurement of a rank runs
MEASURE_S = 0.5
_GEMM_N = 512
_COPY_BYTES = 32 << 20
_LINK_BYTES = 4 << 20
#: round trips per link; its figure is the fastest one's
_LINK_TRIPS = 8
#: the most rounds of link measurements: the ring's 2 or 3, the shuffle's 1
MAX_ROUNDS = 4


@dataclass(frozen=True)
class RankFigures:
    rank: int
    node: str
    gflops: float
    memory_gbps: float


def _repeat(work, device: torch.device) -> float:
    """Calls of ``work`` per second, over MEASURE_S."""
    work()  # warm-up: allocations, kernels, caches
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MEASURE_S or calls == 0:
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls += 1
    return calls / elapsed


def measure_rank(env: JobEnv, device: torch.device) -> RankFigures:
    a = torch.randn(_GEMM_N, _GEMM_N, device=device)
    b = torch.randn(_GEMM_N, _GEMM_N, device=device)
    gemms = _repeat(lambda: torch.mm(a, b), device)
    source = torch.empty(_COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    copies = _repeat(lambda: target.copy_(source), device)
    return RankFigures(env.rank, env.node_name, gemms * 2 * _GEMM_N ** 3 / 1e9,
                       copies * 2 * _COPY_BYTES / 1e9)  # a copy reads and writes each byte


def link_rounds(count: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs of ``count`` nodes (by position): the ring's links and one
    shuffled matching's, each placed in the first round where both its nodes are free (pure:
    every rank computes the same rounds). At most MAX_ROUNDS: the ring needs 2 (3 when
    ``count`` is odd), and the shuffle's pairs, disjoint, need one more at most."""
    ring = [(i, i + 1) for i in range(count - 1)] + ([(0, count - 1)] if count > 2 else [])
    order = list(range(count))
    random.Random(count).shuffle(order)
    shuffled = [tuple(sorted(order[i:i + 2])) for i in range(0, count - 1, 2)]
    rounds: list[tuple[list[tuple[int, int]], set[int]]] = []
    for first, second in dict.fromkeys(ring + shuffled):
        free = next((r for r in rounds if first not in r[1] and second not in r[1]), None)
        if free is None:
            rounds.append(free := ([], set()))
        free[0].append((first, second))
        free[1].update((first, second))
    return [pairs for pairs, _ in rounds]


def measure_links(rank: int, leaders: dict[str, int],
                  device: torch.device) -> dict[tuple[str, str], float]:
    """GB/s of the links of ``link_rounds`` (known on their two ends only), a round at a time."""
    nodes = sorted(leaders, key=leaders.get)
    payload = torch.ones(_LINK_BYTES // 4, device=device)
    links = {}
    for pairs in link_rounds(len(nodes)):
        dist.barrier()  # a round's pairs measure together, not beside the last round's
        for i, j in pairs:
            a, b = leaders[nodes[i]], leaders[nodes[j]]
            if rank in (a, b):
                links[(nodes[i], nodes[j])] = _bounce(b if rank == a else a, rank == a,
                                                      payload)
    return links


def _bounce(peer: int, first: bool, payload: torch.Tensor) -> float:
    """GB/s of the fastest of ``_LINK_TRIPS`` round trips of ``payload`` between this rank and
    ``peer`` (``first``: this rank sends first). The fastest, not the mean: a link that is
    slow (a lower speed negotiated, the wrong interface or route) is slow on every trip, while
    a trip slowed by what else ran on either node then, or by the far end's CPU, says nothing
    of the link."""
    fastest = float("inf")
    for _ in range(_LINK_TRIPS):
        start = time.perf_counter()
        if first:
            dist.send(payload, dst=peer)
            dist.recv(payload, src=peer)
        else:
            dist.recv(payload, src=peer)
            dist.send(payload, dst=peer)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * _LINK_BYTES / 1e9 / fastest


@dataclass(frozen=True)
class NodeRow:
    node: str
    ranks: int
    gflops: float
    memory_gbps: float
    link_gbps: float | None


def node_rows(ranks: list[RankFigures],
              links: dict[tuple[str, str], float]) -> list[NodeRow]:
    """One row per node: its slowest rank's figures, the median of its links."""
    rows = []
    for node in dict.fromkeys(r.node for r in ranks):
        mine = [r for r in ranks if r.node == node]
        own = [gbps for pair, gbps in links.items() if node in pair]
        rows.append(NodeRow(node, len(mine), min(r.gflops for r in mine),
                            min(r.memory_gbps for r in mine),
                            statistics.median(own) if own else None))
    return rows


def slow_nodes(rows: list[NodeRow]) -> dict[str, str]:
    """The nodes below SLOW_FRACTION of the median on a figure, each with the reason."""
    slow: dict[str, str] = {}
    figures = [("GEMM", "gflops", "GFLOP/s"), ("memory", "memory_gbps", "GB/s")]
    if len(rows) >= 3:
        figures.append(("link", "link_gbps", "GB/s"))
    for label, field, unit in figures:
        values = {row.node: getattr(row, field) for row in rows
                  if getattr(row, field) is not None}
        if len(values) < 2:
            continue
        bar = SLOW_FRACTION * statistics.median(values.values())
        for node, value in values.items():
            if value < bar:
                reason = f"{label} {value:.3g} {unit} < {bar:.3g} ({SLOW_FRACTION}x median)"
                slow[node] = f"{slow[node]}; {reason}" if node in slow else reason
    return slow


def format_table(rows: list[NodeRow], slow: dict[str, str]) -> str:
    lines = [f"{'node':<16} {'ranks':>5} {'GEMM GFLOP/s':>13} {'memory GB/s':>12} "
             f"{'link GB/s':>10}  verdict"]
    for row in rows:
        link = "-" if row.link_gbps is None else f"{row.link_gbps:.3g}"
        lines.append(f"{row.node:<16} {row.ranks:>5} {row.gflops:>13.4g} "
                     f"{row.memory_gbps:>12.4g} {link:>10}  {slow.get(row.node, 'ok')}")
    return "\n".join(lines)


def run(env: JobEnv, backends: list[str], timeout_s: float, slow_file: Path | None,
        asked: bool = True) -> int:
    """Every rank: measure over the one backend; rank 0 prints the table and writes
    ``slow_file`` (one node name per line, empty when every node is fine). 0 once measured."""
    if not asked or len(backends) != 1:
        raise LaunchError("--preflight measures over one backend; --slow-nodes needs --preflight",
                          hint="python -m launcher.check --preflight --slow-nodes FILE "
                          "[--backend NAME]")
    with process_group(env, backends[0], timeout_s) as ctx:
        _measure(ctx.env, ctx.device, slow_file)
    return 0


def _measure(env: JobEnv, device: torch.device, slow_file: Path | None) -> None:
    say = print if env.is_main else _quiet
    dist.barrier()  # all ranks measure at once, sharing their nodes as in training
    figures = gather(measure_rank(env, device))
    leaders: dict[str, int] = {}
    for figure in figures:
        leaders.setdefault(figure.node, figure.rank)
    link_device = device if dist.get_backend() != "gloo" else torch.device("cpu")
    links = {pair: gbps for found in gather(measure_links(env.rank, leaders, link_device))
             for pair, gbps in found.items()}
    rows = node_rows(figures, links)
    slow = slow_nodes(rows)
    say(format_table(rows, slow), flush=True)
    say(f"preflight: {len(slow)} slow node(s) of {len(rows)}"
        + (f": {', '.join(slow)}" if slow else ""), flush=True)
    if env.is_main and slow_file is not None:
        write_atomic(slow_file, "".join(f"{node}\n" for node in slow).encode())


def _quiet(*_args: object, **_kwargs: object) -> None:
    pass
