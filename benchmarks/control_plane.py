"""The control plane's cost as the job grows: today's all-to-all heartbeats against the side
channel's watch topology (``launcher.faults.side_store``), side by side in one run.

    python -m benchmarks.control_plane [--ranks 8 64 256 1024] [--seconds 6] \
        [--json benchmarks/results/control-plane.json]

Simulated ranks are threads of this process; the rendezvous store is a real TCPStore served by
a process of its own (as rank 0's store is served beside its training). Each simulated rank
opens what a rank of that design opens (today: the rendezvous client, the heartbeat's client and
the fail-fast watcher's client; the side channel: the rendezvous client and the channel's
client) and beats every ``heartbeat.BEAT_S`` with a random phase. Measured over ``--seconds``
after a warm-up:

- the store's process (the busiest one, rank 0 in a job): CPU seconds per second (its threads'
  /proc/PID/task/*/schedstat), bytes per second through its sockets (/proc/PID/io), store calls
  per second
  it serves, and its connections (its sockets, from /proc/PID/fd);
- per rank: CPU seconds per second of its beating thread (``time.thread_time``), calls and keys
  per second;
- the share of the beats that were on time (a store that cannot keep up delays them).

The model: the store's CPU per call and per key read, fitted (least squares) on all the points
of both designs, then applied to each design's calls and keys at 10,000 and 100,000 ranks; per
rank, the median thread CPU per beat. Table, JSON and a PNG plot beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from launcher.faults import heartbeat
from launcher.faults.side_store import StoreSideChannel
from launcher.placement.env import detect_environment

RANKS_PER_NODE = 8
EXTRAPOLATE = (10_000, 100_000)
_SERVE = ("import sys, time, torch.distributed as d; "
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
          "print(s.port, flush=True); sys.stdin.read()")


class TodaysBeats:
    """Today's design (launcher/heartbeat.py's StoreBeats before the side channel): every rank
    sets its counter and reads every rank's, each beat, on a client of its own."""

    def __init__(self, rank: int, size: int, port: int):
        self._client = _client(port)
        self._key = f"hb/{rank}"
        self._keys = [f"hb/{other}" for other in range(size)]
        self._client.set(self._key, "0")
        self._client.wait(self._keys, timedelta(seconds=120))
        self._count = 0
        self.calls, self.keys = 2, size + 1
        self.watcher = _client(port)  # the fail-fast watcher's connection

    def exchange(self) -> set[int]:
        self._count += 1
        self._client.set(self._key, str(self._count))
        self._client.multi_get(self._keys)
        return set()


class ChannelBeats:
    """The side channel's beat: one set and one multi_get of the watched ranks' keys."""

    def __init__(self, rank: int, size: int, port: int):
        hosts = tuple(f"node{n}" for n in range(-(-size // RANKS_PER_NODE)))
        env = replace(detect_environment({}, hostname="sim"), rank=rank, world_size=size,
                      node_rank=rank // RANKS_PER_NODE, hosts=hosts, master_addr="127.0.0.1",
                      master_port=port)
        self._channel = StoreSideChannel(env, None)
        self.calls, self.keys = 2, 1 + len(self._channel.watch.watched) + 2

    def exchange(self) -> set[int]:
        return self._channel.exchange()


DESIGNS = {"today (all-to-all)": TodaysBeats, "side channel (watch)": ChannelBeats}


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))


def _proc(pid: int) -> dict[str, float]:
    on_cpu_ns = sum(int((task / "schedstat").read_text().split()[0])
                    for task in Path(f"/proc/{pid}/task").iterdir())
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    sockets = sum(1 for fd in Path(f"/proc/{pid}/fd").iterdir()
                  if os.readlink(fd).startswith("socket:"))
    return {"cpu": on_cpu_ns / 1e9,
            "bytes": int(io["rchar"]) + int(io["wchar"]), "sockets": sockets}


def measure(design: str, size: int, seconds: float) -> dict:
    """One design at ``size`` simulated ranks against a fresh store process."""
    server = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        rendezvous = [None] * size
        ranks = [None] * size

        def open_rank(rank: int) -> None:
            rendezvous[rank] = _client(port)
            ranks[rank] = DESIGNS[design](rank, size, port)

        _all_threads([threading.Thread(target=open_rank, args=(r,)) for r in range(size)])
        stop = threading.Event()
        begin, end = time.monotonic() + 2 * heartbeat.BEAT_S, time.monotonic() + 2 * \
            heartbeat.BEAT_S + seconds
        cpu = [0.0] * size
        beats = [0] * size
        late = [0] * size

        def beat(rank: int) -> None:
            due = time.monotonic() + random.random() * heartbeat.BEAT_S
            while not stop.is_set():
                time.sleep(max(0.0, due - time.monotonic()))
                started, used = time.monotonic(), time.thread_time()
                ranks[rank].exchange()
                if begin <= started < end:
                    cpu[rank] += time.thread_time() - used
                    beats[rank] += 1
                    late[rank] += started - due > heartbeat.BEAT_S / 2
                due += heartbeat.BEAT_S
                if due < time.monotonic():  # behind: the next beat now, counted late
                    due = time.monotonic()

        threads = [threading.Thread(target=beat, args=(r,), daemon=True) for r in range(size)]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, begin - time.monotonic()))
        before = _proc(server.pid)
        time.sleep(seconds)
        after = _proc(server.pid)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        server.kill()
        server.wait()
    one = ranks[0]
    total_beats = sum(beats)
    return {
        "design": design, "ranks": size,
        "store_cpu_s_per_s": (after["cpu"] - before["cpu"]) / seconds,
        "store_bytes_per_s": (after["bytes"] - before["bytes"]) / seconds,
        "store_calls_per_s": total_beats * one.calls / seconds,
        "store_keys_per_s": total_beats * one.keys / seconds,
        # less the listening socket and both ends of the store's own client
        "store_connections": before["sockets"] - 3,
        "rank_calls_per_s": total_beats * one.calls / seconds / size,
        "rank_cpu_s_per_s": statistics.median(cpu) / seconds,
        "rank_connections_to_store": (before["sockets"] - 3) / size,
        "beats_on_time": 1 - sum(late) / max(1, total_beats),
        "beats_done": total_beats / (size * seconds / heartbeat.BEAT_S),
    }


def _all_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def model(rows: list[dict]) -> dict:
    """The store's CPU per call and per key, least squares through the origin on all rows."""
    pairs = [(row["store_calls_per_s"], row["store_keys_per_s"], row["store_cpu_s_per_s"])
             for row in rows]
    scc = sum(c * c for c, _, _ in pairs)
    skk = sum(k * k for _, k, _ in pairs)
    sck = sum(c * k for c, k, _ in pairs)
    scy = sum(c * y for c, _, y in pairs)
    sky = sum(k * y for _, k, y in pairs)
    det = scc * skk - sck * sck
    per_call = (scy * skk - sky * sck) / det
    per_key = (scc * sky - sck * scy) / det
    return {"cpu_s_per_call": max(per_call, 0.0), "cpu_s_per_key": max(per_key, 0.0)}


def extrapolate(rows: list[dict], fit: dict) -> list[dict]:
    out = []
    for design in DESIGNS:
        mine = [row for row in rows if row["design"] == design]
        largest = max(mine, key=lambda row: row["ranks"])
        keys_per_rank = largest["store_keys_per_s"] / largest["ranks"]
        calls_per_rank = largest["store_calls_per_s"] / largest["ranks"]
        cpu_per_beat = statistics.median(row["rank_cpu_s_per_s"] for row in mine)
        for size in EXTRAPOLATE:
            keys = size * (size + 1) if design.startswith("today") else size * keys_per_rank
            calls = size * calls_per_rank
            out.append({
                "design": design, "ranks": size, "modelled": True,
                "store_cpu_s_per_s": calls * fit["cpu_s_per_call"] + keys * fit["cpu_s_per_key"],
                "store_calls_per_s": calls, "store_keys_per_s": keys,
                "store_connections": size * (3 if design.startswith("today") else 2),
                "rank_cpu_s_per_s": cpu_per_beat * (size / largest["ranks"]
                                                    if design.startswith("today") else 1),
            })
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'design':22} {'ranks':>7} {'store CPU':>10} {'store calls/s':>13} "
            f"{'store keys/s':>13} {'store B/s':>10} {'conns':>6} {'rank CPU':>9} "
            f"{'on time':>8}")
    lines = [head, "-" * len(head)]
    for row in rows:
        mark = "~" if row.get("modelled") else " "
        lines.append(
            f"{row['design']:22} {row['ranks']:>7}{mark}{row['store_cpu_s_per_s']:>9.2%} "
            f"{row['store_calls_per_s']:>13,.0f} {row['store_keys_per_s']:>13,.0f} "
            f"{row.get('store_bytes_per_s', float('nan')):>10,.0f} "
            f"{row['store_connections']:>6} {row['rank_cpu_s_per_s']:>9.3%} "
            f"{row.get('beats_on_time', float('nan')):>8.0%}")
    lines.append("~: by the model (store CPU per call and per key fitted on the measured rows)")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for design in DESIGNS:
        mine = sorted((row for row in rows if row["design"] == design),
                      key=lambda row: row["ranks"])
        axes.plot([row["ranks"] for row in mine], [row["store_cpu_s_per_s"] for row in mine],
                  marker="o", label=f"{design}: store (busiest)")
        axes.plot([row["ranks"] for row in mine], [row["rank_cpu_s_per_s"] for row in mine],
                  marker="x", linestyle="--", label=f"{design}: per rank")
    axes.axhline(0.01, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("ranks (10,000 and 100,000 by the model)")
    axes.set_ylabel("CPU seconds per second")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for size in args.ranks:
        for design in DESIGNS:
            rows.append(measure(design, size, args.seconds))
            print(table(rows[-1:]).splitlines()[2], flush=True)
    fit = model(rows)
    rows += extrapolate(rows, fit)
    print(table(rows))
    print(f"model: {fit['cpu_s_per_call'] * 1e6:.1f} us per store call, "
          f"{fit['cpu_s_per_key'] * 1e9:.0f} ns per key read")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "model": fit}, indent=1) + "\n")
        plot(rows, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
