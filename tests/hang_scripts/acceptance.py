"""The acceptance of issue 36, as a new user would write it: 4 ranks, rank 2 skips the 5th
all_reduce. python acceptance.py RUN_DIR"""

import sys

import torch
import torch.distributed as dist

import launcher

with launcher.distributed(timeout_s=20, status_dir=sys.argv[1]) as job:
    grads, loss = torch.ones(8), torch.ones(1)
    for step in range(1, 4):
        if not (job.rank == 2 and step == 3):
            dist.all_reduce(grads)  # the gradients: calls 1, 3, 5
        dist.all_reduce(loss)  # the loss: calls 2, 4, 6
    job.print("done")
