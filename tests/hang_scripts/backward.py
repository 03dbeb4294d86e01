"""Rank 1 spins before its 3rd backward while the other ranks wait in DDP's gradient all_reduce
(tests/test_hang.py): python backward.py BACKEND RUN_DIR. The script's own DDP, not job.wrap's:
every DDP's backward is recorded."""

import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import launcher

backend, run_dir = sys.argv[1:3]
with launcher.distributed(backend=backend, timeout_s=5, status_dir=run_dir) as job:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(1, 5):
        loss = model(torch.ones(8, 4)).sum()
        if job.rank == 0 and step == 3:
            print(f"waiting since {time.monotonic()}", flush=True)
        if job.rank == 1 and step == 3:
            while True:
                time.sleep(0.001)  # the spin
        loss.backward()  # the backward
    job.print("done")
