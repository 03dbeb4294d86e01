"""What the hardware allows an all_reduce, measured on the ranks of the benchmark (see
benchmarks/allreduce.py): the link between ranks 0 and 1, every rank's bandwidth while all
ranks exchange at once, and one core's memcpy."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.timing import COMM, measure

#: the message of the floor measurements: large enough that latency is noise
FLOOR_BYTES = 64 << 20


def floor(args) -> dict[str, float]:
    """The physical limits in GB/s: the link between ranks 0 and 1 (one way), every rank's
    link while all ranks exchange at once (as in each step of a ring), and memcpy."""
    buffer = np.zeros(FLOOR_BYTES // 4, dtype=np.float32)
    inbox = np.empty_like(buffer)
    me, n = COMM.rank, COMM.size

    def exchange():
        COMM.Sendrecv(buffer, dest=(me + 1) % n, recvbuf=inbox, source=(me - 1) % n)

    def pingpong():
        if COMM.rank == 0:
            COMM.Send(buffer, dest=1)
            COMM.Recv(buffer, source=1)
        elif COMM.rank == 1:
            COMM.Recv(buffer, source=0)
            COMM.Send(buffer, dest=0)

    timed = measure({"link": pingpong, "exchange": exchange}, args)
    round_trip = timed["link"]
    source, target = np.ones_like(buffer), np.empty_like(buffer)
    copies = []
    for _ in range(10):
        start = time.perf_counter()
        np.copyto(target, source)
        copies.append(time.perf_counter() - start)
    return {"link_GBps": 2 * FLOOR_BYTES / round_trip["best"] / 1e9,
            "link_median_GBps": 2 * FLOOR_BYTES / round_trip["median"] / 1e9,
            "exchange_GBps": FLOOR_BYTES / timed["exchange"]["best"] / 1e9,
            "memcpy_GBps": FLOOR_BYTES / min(copies) / 1e9}
