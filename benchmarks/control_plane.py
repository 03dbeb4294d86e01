"""The control plane's cost as the job grows: three designs of the heartbeats side by side in
one run.

    python -m benchmarks.control_plane [--ranks 8 64 256 1024] [--seconds 6] \
        [--json benchmarks/results/control-plane.json]

- **all-to-all** (before issue #35): every rank sets its counter in rank 0's store and reads
  every rank's, each beat, on a client of its own (three connections per rank to rank 0).
- **store watch** (issue #35's first step): each rank sets its counter and reads its two
  watched peers', its mailbox and the broadcast key: 2 calls per rank per beat, still at
  rank 0.
- **peer to peer** (today, ``launcher.faults.side_socket``): each rank's beat goes straight to
  its two watchers over TCP; the store serves the start only.

Simulated ranks are threads of this process (the designs are in
``benchmarks.control_plane_designs``); the rendezvous store is a real TCPStore served by a
process of its own (as rank 0's store is served beside its training). Measured over
``--seconds`` after a warm-up:

- the busiest process: for the store designs the store's (its threads' CPU from
  /proc/PID/task/*/schedstat, its bytes from /proc/PID/io, its sockets from /proc/PID/fd, the
  calls it serves); peer to peer, the simulated rank whose threads (beating, reading, handling)
  used the most CPU, and the messages it took;
- per rank: the median CPU seconds per second of its threads, its messages per second;
- the share of the beats on time; peer to peer, how long a broadcast (a failure notice) takes
  to reach every rank: the first (which connects to the tree neighbours as it goes, as a real
  notice does) and, in the JSON, the median of two more.

The model (``benchmarks.control_plane_fit``): for the store designs the store's CPU per call
and per key read, fitted (least squares) on their measured rows; peer to peer, the busiest
rank's CPU fitted as a + b N (b is the simulation's own crowding: the work per rank is the
same 4 messages a second at every size), and a rank's part of a broadcast (the simulated ranks
take theirs one after another in one interpreter), from which a real job's notice time
follows along the trees' longest path. Applied at 10,000 and 100,000 ranks. Table, JSON and a PNG
plot beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.control_plane_designs import DESIGNS, NOTICE, PeerToPeer
from benchmarks.control_plane_fit import busiest_fit, extrapolate, notice_fit, store_fit
from launcher.faults import heartbeat

_SERVE = ("import sys, time, torch.distributed as d; "
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
          "print(s.port, flush=True); sys.stdin.read()")


def _proc(pid: int) -> dict[str, float]:
    on_cpu_ns = sum(int((task / "schedstat").read_text().split()[0])
                    for task in Path(f"/proc/{pid}/task").iterdir())
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    sockets = sum(1 for fd in Path(f"/proc/{pid}/fd").iterdir()
                  if fd.is_symlink() and fd.readlink().name.startswith("socket:"))
    return {"cpu": on_cpu_ns / 1e9,
            "bytes": int(io["rchar"]) + int(io["wchar"]), "sockets": sockets}


def _all_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Beating:
    """Every simulated rank's beating thread, with a random phase, and what it measured."""

    def __init__(self, ranks: list, begin: float, end: float):
        self._ranks, self._begin, self._end = ranks, begin, end
        size = len(ranks)
        self.cpu, self.beats, self.late = [0.0] * size, [0] * size, [0] * size
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, args=(r,), daemon=True)
                         for r in range(size)]
        for thread in self._threads:
            thread.start()

    def _beat(self, rank: int) -> None:
        due = time.monotonic() + random.random() * heartbeat.BEAT_S
        while not self._stop.is_set():
            time.sleep(max(0.0, due - time.monotonic()))
            started, used = time.monotonic(), time.thread_time()
            self._ranks[rank].exchange()
            if self._begin <= started < self._end:
                self.cpu[rank] += time.thread_time() - used
                self.beats[rank] += 1
                self.late[rank] += started - due > heartbeat.BEAT_S / 2
            due += heartbeat.BEAT_S
            if due < time.monotonic():  # behind: the next beat now, counted late
                due = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def _notice_s(ranks: list[PeerToPeer]) -> float:
    """How long one broadcast from a random rank takes to reach every other rank."""
    origin = random.randrange(len(ranks))
    for rank in ranks:
        rank.notice_at = None
    sent = time.monotonic()
    ranks[origin].channel.broadcast(NOTICE, b"rank failed")
    deadline = sent + 30
    while time.monotonic() < deadline and any(
            rank.notice_at is None for index, rank in enumerate(ranks) if index != origin):
        time.sleep(0.005)
    arrived = [rank.notice_at for index, rank in enumerate(ranks) if index != origin]
    return max(at - sent for at in arrived) if None not in arrived else float("nan")


def measure(design: str, size: int, seconds: float) -> dict:
    """One design at ``size`` simulated ranks against a fresh store process."""
    server = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    ranks: list = [None] * size
    try:
        port = int(server.stdout.readline())

        def open_rank(rank: int) -> None:
            ranks[rank] = DESIGNS[design](rank, size, port)

        _all_threads([threading.Thread(target=open_rank, args=(r,)) for r in range(size)])
        warm = 2 * heartbeat.BEAT_S
        begin = time.monotonic() + warm
        beating = Beating(ranks, begin, begin + seconds)
        time.sleep(warm)
        peer = design == "peer to peer"
        threads_before = [rank.threads_cpu() for rank in ranks] if peer else []
        before = _proc(server.pid)
        time.sleep(seconds)
        after = _proc(server.pid)
        threads_after = [rank.threads_cpu() for rank in ranks] if peer else []
        beating.stop()
        notices = [_notice_s(ranks) for _ in range(3)] if peer else []
    finally:
        for rank in ranks:
            if isinstance(rank, PeerToPeer):
                rank.channel.close()
        server.kill()
        server.wait()
    return _row(design, size, seconds, ranks[0], beating, before, after,
                [b - a for a, b in zip(threads_before, threads_after, strict=True)], notices)


def _row(design, size, seconds, one, beating, before, after, threads_cpu, notices) -> dict:
    total_beats = sum(beating.beats)
    rank_cpu = [(cpu + (threads_cpu[rank] if threads_cpu else 0.0)) / seconds
                for rank, cpu in enumerate(beating.cpu)]
    store_cpu = (after["cpu"] - before["cpu"]) / seconds
    # less the listening socket and both ends of the store's own client
    store_connections = before["sockets"] - 3
    watchers = 2
    row = {
        "design": design, "ranks": size,
        "store_cpu_s_per_s": store_cpu,
        "store_bytes_per_s": (after["bytes"] - before["bytes"]) / seconds,
        "store_calls_per_s": total_beats * one.store_calls / seconds,
        "store_keys_per_s": total_beats * one.store_keys / seconds,
        "store_connections": store_connections,
        "rank_cpu_s_per_s": statistics.median(rank_cpu),
        "beats_on_time": 1 - sum(beating.late) / max(1, total_beats),
        "beats_done": total_beats / (size * seconds / heartbeat.BEAT_S),
    }
    if design == "peer to peer":
        # each beat is a message out and one into a watcher; two of each per rank
        # the first broadcast makes its connections as it goes, as a failure notice does
        row.update(busiest_cpu_s_per_s=max(rank_cpu),
                   busiest_messages_per_s=2 * watchers * total_beats / size / seconds,
                   busiest_connections=2 * watchers, notice_s=notices[0],
                   notice_again_s=statistics.median(notices[1:]))
    else:
        row.update(busiest_cpu_s_per_s=store_cpu,
                   busiest_messages_per_s=row["store_calls_per_s"],
                   busiest_connections=store_connections)
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'design':13} {'ranks':>7} {'busiest CPU':>11} {'its msgs/s':>10} "
            f"{'its conns':>9} {'store keys/s':>13} {'rank CPU':>9} {'on time':>7} "
            f"{'notice':>8}")
    lines = [head, "-" * len(head)]
    for row in rows:
        mark = "~" if row.get("modelled") else " "
        notice = row.get("notice_s")
        lines.append(
            f"{row['design']:13} {row['ranks']:>7}{mark}{row['busiest_cpu_s_per_s']:>10.3%} "
            f"{row['busiest_messages_per_s']:>10,.0f} {row['busiest_connections']:>9,} "
            f"{row['store_keys_per_s']:>13,.0f} {row['rank_cpu_s_per_s']:>9.3%} "
            f"{row.get('beats_on_time', float('nan')):>7.0%} "
            + (f"{notice * 1e3:>6.0f}ms" if notice is not None else f"{'-':>8}"))
    lines.append("busiest: the store's process (rank 0's) for the store designs, the busiest "
                 "rank peer to peer; notice: a broadcast to every rank; ~: by the model")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for design in DESIGNS:
        mine = sorted((row for row in rows if row["design"] == design),
                      key=lambda row: row["ranks"])
        axes.plot([row["ranks"] for row in mine], [row["busiest_cpu_s_per_s"] for row in mine],
                  marker="o", label=f"{design}: busiest process")
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
    fits = {"store": store_fit([row for row in rows if row["design"] != "peer to peer"]),
            "busiest": busiest_fit([row for row in rows if row["design"] == "peer to peer"]),
            "notice": notice_fit([row for row in rows if row["design"] == "peer to peer"])}
    rows += extrapolate(rows, fits)
    print(table(rows))
    store, busy, notice = fits["store"], fits["busiest"], fits["notice"]
    print(f"model: store {store['cpu_s_per_call'] * 1e6:.1f} us per call, "
          f"{store['cpu_s_per_key'] * 1e9:.0f} ns per key read; peer to peer busiest rank "
          f"{busy['a'] * 100:.3f} % + {busy['b'] * 100:.2e} % per rank; a rank's part of "
          f"a broadcast {notice['s_per_rank'] * 1e3:.2f} ms, {math.ceil(math.log2(10_000))} "
          f"hops at 10,000")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "model": fits}, indent=1) + "\n")
        plot(rows, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
