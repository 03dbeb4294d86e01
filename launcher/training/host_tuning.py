"""What a rank sets on its host before training: threads per rank, deterministic kernels."""

from __future__ import annotations

import math
import os

import torch

from launcher.placement import settings
from launcher.placement.env import JobEnv


def use_cores_fairly(threads: int, env: JobEnv, device: torch.device) -> None:
    # ranks sharing a node would otherwise each start one thread per core and oversubscribe it
    if device.type != "cpu":
        return
    if threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, math.floor((cores or 1) / env.local_world_size))
    torch.set_num_threads(threads)


def use_deterministic_kernels() -> None:
    # cuBLAS reads the variable when it creates its first handle: before the model's first
    # matmul. warn_only: an op with no deterministic kernel warns instead of stopping the run
    settings.prefer("CUBLAS_WORKSPACE_CONFIG", ":4096:8",
                    "--deterministic: cuBLAS's deterministic workspace")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
