"""What a rank sets on its host before training: threads per rank, deterministic kernels."""

from __future__ import annotations

import torch

from launcher.group.process_group import gpu_addresses
from launcher.placement import cpus, settings
from launcher.placement.cpus import Binding
from launcher.placement.env import JobEnv
from launcher.placement.gpu_numa import local_gpu_nodes


def use_cores_fairly(threads: int, env: JobEnv, device: torch.device, bind: str) -> Binding:
    """Bind this rank's CPUs (``launcher.placement.cpus``; beside its GPU on GPU hosts), then
    give torch as many threads as it has CPUs of its own: ranks sharing a node would otherwise
    each start one thread per core and oversubscribe it. A LaunchError for a binding that
    cannot be (call it inside agree)."""
    gpus = None
    if device.type == "cuda":
        gpus = local_gpu_nodes(gpu_addresses(device), env.local_world_size)
    binding = cpus.bind(bind, env.local_rank, env.local_world_size, gpus)
    if device.type == "cpu":
        torch.set_num_threads(threads or binding.threads)
    return binding


def use_deterministic_kernels() -> None:
    # cuBLAS reads the variable when it creates its first handle: before the model's first
    # matmul. warn_only: an op with no deterministic kernel warns instead of stopping the run
    settings.prefer("CUBLAS_WORKSPACE_CONFIG", ":4096:8",
                    "--deterministic: cuBLAS's deterministic workspace")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
