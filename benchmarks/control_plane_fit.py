"""The control-plane benchmark's model: fitted on its measured rows, applied at sizes no
machine here can simulate (``benchmarks.control_plane``)."""

from __future__ import annotations

import math
import statistics

EXTRAPOLATE = (10_000, 100_000)
#: connections each design's rank holds to the busiest process
_CONNECTIONS = {"all-to-all": 3, "store watch": 2}


def _line(points: list[tuple[float, float]]) -> dict:
    """Least squares y = a + b x; b alone, through the mean, needs two distinct x."""
    xs = [x for x, _ in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return {"a": mean_y - b * mean_x, "b": b}


def store_fit(rows: list[dict]) -> dict:
    """The store's CPU per call and per key, least squares through the origin."""
    pairs = [(row["store_calls_per_s"], row["store_keys_per_s"], row["store_cpu_s_per_s"])
             for row in rows]
    scc = sum(c * c for c, _, _ in pairs)
    skk = sum(k * k for _, k, _ in pairs)
    sck = sum(c * k for c, k, _ in pairs)
    scy = sum(c * y for c, _, y in pairs)
    sky = sum(k * y for _, k, y in pairs)
    det = scc * skk - sck * sck
    per_call = (scy * skk - sky * sck) / det if det else 0.0
    per_key = (scc * sky - sck * scy) / det if det else 0.0
    return {"cpu_s_per_call": max(per_call, 0.0), "cpu_s_per_key": max(per_key, 0.0)}


def busiest_fit(rows: list[dict]) -> dict:
    """Peer to peer, the busiest rank's CPU as a + b N: b is what it grows by per rank."""
    return _line([(row["ranks"], row["busiest_cpu_s_per_s"]) for row in rows])


def notice_fit(rows: list[dict]) -> dict:
    """What one rank's part of a broadcast costs: the simulated ranks share one interpreter,
    so a broadcast's measured time is every rank's part one after another (least squares
    through the origin of time against N)."""
    points = [(row["ranks"], row["notice_s"]) for row in rows if not math.isnan(row["notice_s"])]
    return {"s_per_rank": sum(n * t for n, t in points) / sum(n * n for n, _ in points)}


def notice_s(fit: dict, size: int) -> float:
    """A broadcast's time to every rank of a real job, where ranks pass it on in parallel: along
    the longest path of ceil(log2 N) hops, each rank sending to up to 2 ceil(log2 N) children
    (both trees, the one on the path possibly last), each send a whole rank's part. The
    network's latency per hop comes on top (tens of microseconds)."""
    hops = math.ceil(math.log2(size))
    return hops * 2 * hops * fit["s_per_rank"]


def extrapolate(rows: list[dict], fits: dict) -> list[dict]:
    out = []
    for design in dict.fromkeys(row["design"] for row in rows):
        mine = [row for row in rows if row["design"] == design]
        largest = max(mine, key=lambda row: row["ranks"])
        for size in EXTRAPOLATE:
            out.append(_modelled(design, size, largest, mine, fits))
    return out


def _modelled(design: str, size: int, largest: dict, mine: list[dict], fits: dict) -> dict:
    per_rank_cpu = statistics.median(row["rank_cpu_s_per_s"] for row in mine)
    row = {"design": design, "ranks": size, "modelled": True}
    if design == "peer to peer":
        busy, notice = fits["busiest"], fits["notice"]
        return row | {
            "busiest_cpu_s_per_s": busy["a"] + max(busy["b"], 0.0) * size,
            "busiest_messages_per_s": largest["busiest_messages_per_s"],
            "busiest_connections": largest["busiest_connections"],
            "store_keys_per_s": 0.0, "rank_cpu_s_per_s": per_rank_cpu,
            "notice_s": notice_s(notice, size)}
    store = fits["store"]
    calls = size * largest["store_calls_per_s"] / largest["ranks"]
    keys = size * (size + 1) if design == "all-to-all" else \
        size * largest["store_keys_per_s"] / largest["ranks"]
    grows = size / largest["ranks"] if design == "all-to-all" else 1
    return row | {
        "busiest_cpu_s_per_s": calls * store["cpu_s_per_call"] + keys * store["cpu_s_per_key"],
        "busiest_messages_per_s": calls, "busiest_connections": size * _CONNECTIONS[design],
        "store_keys_per_s": keys, "rank_cpu_s_per_s": per_rank_cpu * grows}
