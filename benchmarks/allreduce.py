"""all_reduce and point-to-point latency: the mpi4py backend vs gloo vs raw mpi4py, one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py --json allreduce.json

Every rank takes part; rank 0 prints the table and writes the JSON. Sizes are float32 buffers
from 4 KiB to 64 MiB. The three contenders are measured in turn, several rounds each, and the
best round counts: on a shared machine the minimum is the least noisy estimate of what the
code costs. Bandwidth is algorithm bandwidth (bytes reduced per second of one all_reduce).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launcher import mpi_backend  # noqa: E402 - the repo root goes on sys.path first

COMM = MPI.COMM_WORLD
SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
CONTENDERS = ("mpi4py", "gloo", "raw")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size and contender")
    parser.add_argument("--round-seconds", type=float, default=0.05,
                        help="target duration of one round")
    parser.add_argument("--pingpongs", type=int, default=2000, help="round trips per p2p round")
    return parser.parse_args()


def init_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """gloo as the default group (its port chosen on rank 0, sent over MPI), mpi4py beside it."""
    port = None
    if COMM.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(COMM.bcast(port, root=0))
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group("gloo", rank=COMM.rank, world_size=COMM.size, timeout=timeout)
    ours = dist.new_group(backend=mpi_backend.register(), timeout=timeout)
    return dist.group.WORLD, ours


def timed(op, iterations: int) -> float:
    """Seconds per call of ``op`` over ``iterations`` calls, all ranks starting together."""
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        op()
    elapsed = time.perf_counter() - start
    return COMM.allreduce(elapsed, op=MPI.MAX) / iterations


def best(ops: dict, rounds: int, round_seconds: float) -> dict[str, float]:
    """Best seconds-per-call of each op; iteration counts agreed on rank 0's warm-up."""
    iterations = {}
    for name, op in ops.items():
        op()  # warm-up: connections, first-touch of buffers
        per_call = timed(op, 3)
        iterations[name] = COMM.bcast(max(3, int(round_seconds / max(per_call, 1e-7))), root=0)
    times = {name: float("inf") for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            times[name] = min(times[name], timed(op, iterations[name]))
    return times


def allreduce_ops(nbytes: int, gloo, ours) -> dict:
    """One all_reduce of ``nbytes`` per contender, each on its own buffer of zeros (sums stay
    finite however often they run)."""
    mine, theirs = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    raw = torch.zeros(nbytes // 4).numpy()
    return {
        "mpi4py": lambda: dist.all_reduce(mine, group=ours),
        "gloo": lambda: dist.all_reduce(theirs, group=gloo),
        "raw": lambda: COMM.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM),
    }


def allreduce_table(gloo, ours, args) -> list[dict]:
    rows = []
    for nbytes in SIZES:
        ops = allreduce_ops(nbytes, gloo, ours)
        times = best(ops, args.rounds, args.round_seconds)
        row = {"bytes": nbytes}
        for name in CONTENDERS:
            row[f"{name}_us"] = times[name] * 1e6
            row[f"{name}_GBps"] = nbytes / times[name] / 1e9
        row["mpi4py_vs_raw"] = times["raw"] / times["mpi4py"]
        row["mpi4py_vs_gloo"] = times["gloo"] / times["mpi4py"]
        rows.append(row)
    return rows


def pingpong(gloo, ours, args) -> dict[str, float]:
    """Half round-trip latency of a 4-byte message between ranks 0 and 1 (others idle)."""
    me = COMM.rank
    peer = 1 - me if me < 2 else None
    t = {name: torch.zeros(1, dtype=torch.float32) for name in CONTENDERS}
    raw = t["raw"].numpy()

    def torch_pingpong(group, tensor):
        def run():
            if me == 0:
                dist.send(tensor, 1, group=group)
                dist.recv(tensor, 1, group=group)
            elif me == 1:
                dist.recv(tensor, 0, group=group)
                dist.send(tensor, 0, group=group)
        return run

    def raw_pingpong():
        if me == 0:
            COMM.Send(raw, dest=peer)
            COMM.Recv(raw, source=peer)
        elif me == 1:
            COMM.Recv(raw, source=peer)
            COMM.Send(raw, dest=peer)

    ops = {"mpi4py": torch_pingpong(ours, t["mpi4py"]), "gloo": torch_pingpong(gloo, t["gloo"]),
           "raw": raw_pingpong}
    times = {name: float("inf") for name in ops}
    for _ in range(args.rounds):
        for name, op in ops.items():
            times[name] = min(times[name], timed(op, args.pingpongs))
    return {f"{name}_us": times[name] / 2 * 1e6 for name in CONTENDERS}


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def print_table(rows: list[dict], p2p: dict[str, float]) -> None:
    print(f"all_reduce float32, {COMM.size} ranks, best of rounds "
          f"(GB/s = bytes / time of one all_reduce)")
    header = (f"{'size':>8} | {'mpi4py us':>10} {'GB/s':>6} | {'gloo us':>10} {'GB/s':>6} | "
              f"{'raw us':>10} {'GB/s':>6} | {'vs raw':>6} {'vs gloo':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{human(r['bytes']):>8} | {r['mpi4py_us']:>10.1f} {r['mpi4py_GBps']:>6.2f} | "
              f"{r['gloo_us']:>10.1f} {r['gloo_GBps']:>6.2f} | {r['raw_us']:>10.1f} "
              f"{r['raw_GBps']:>6.2f} | {r['mpi4py_vs_raw']:>6.2f} {r['mpi4py_vs_gloo']:>6.2f}x")
    print(f"\nping-pong latency, 4 bytes, half round trip: mpi4py {p2p['mpi4py_us']:.1f} us, "
          f"gloo {p2p['gloo_us']:.1f} us, raw mpi4py {p2p['raw_us']:.1f} us")
    print("vs raw = raw time / mpi4py time (1.0 = as fast as raw mpi4py); "
          "vs gloo = gloo time / mpi4py time (>1 = mpi4py faster)")


def main() -> None:
    args = parse_args()
    gloo, ours = init_groups()
    rows = allreduce_table(gloo, ours, args)
    p2p = pingpong(gloo, ours, args)
    if COMM.rank == 0:
        print_table(rows, p2p)
        if args.json:
            args.json.write_text(json.dumps({
                "world_size": COMM.size,
                "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                "mpi4py_thread_level": MPI.Query_thread(),
                "torch": torch.__version__,
                "allreduce": rows,
                "pingpong": p2p,
            }, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
