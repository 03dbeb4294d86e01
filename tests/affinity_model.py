"""A model whose factory says where its rank runs: ``affinity rank=R cpus=0-3 threads=4``,
for tests/test_cpus.py (``--model tests.affinity_model:factory``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from launcher.placement.cpus import format_cpulist


def factory() -> nn.Module:
    print(f"affinity rank={dist.get_rank()} cpus={format_cpulist(os.sched_getaffinity(0))} "
          f"threads={torch.get_num_threads()}", flush=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
