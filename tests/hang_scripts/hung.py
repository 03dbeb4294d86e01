"""A rank that hangs in one of four ways (tests/test_hang.py): python hung.py HOW BACKEND RUN_DIR.

skip: rank 1 skips the 3rd all_reduce (then its barrier meets the others' 4th all_reduce);
spin: rank 1 loops in Python
before the 3rd; lock: rank 1 waits on a lock of its own before the 3rd; stop: rank 1 stops
itself (SIGSTOP) before the 3rd; async: rank 1 spins, every rank waits on its all_reduce's
Work (``async_op=True``). The other ranks wait in all_reduce #3.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import launcher

how, backend, run_dir = sys.argv[1:4]
with launcher.distributed(backend=backend, timeout_s=5, status_dir=run_dir) as job:
    tensor = torch.ones(4, device=job.device)
    for step in range(1, 5):
        if job.rank == 0 and step == 3:
            print(f"waiting since {time.monotonic()}", flush=True)
        if job.rank == 1 and step == 3:
            if how == "skip":
                continue
            if how in ("spin", "async"):
                while True:
                    time.sleep(0.001)  # the spin
            if how == "lock":
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()  # the lock
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # the stop
        work = dist.all_reduce(tensor, async_op=how == "async")  # the all_reduce
        if work is not None:
            work.wait()
    dist.barrier()  # the barrier
    job.print("done")
