"""NCCL refuses several ranks on one GPU: find out, on every rank alike, whether that is so."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.placement.env import JobEnv

_GPU_KEY = "ddp/gpu"


def nccl_unless_gpus_are_shared(env: JobEnv, store: dist.Store, device: torch.device,
                                if_shared: str) -> str:
    """``nccl``, or what the backend plan says for ranks that share a GPU
    (``BackendPlan.if_gpu_shared``: "gloo", or "refuse" with a LaunchError); NCCL would stop
    such a job at its first collective with "invalid usage". Every rank takes the same
    decision."""
    shared = shared_gpu(env, store, _gpu_identity(device))
    if shared is None:
        return "nccl"
    if if_shared == "refuse":
        raise LaunchError(
            f"NCCL cannot run several ranks on one GPU, and {shared}",
            hint=f"start one rank per GPU ({torch.cuda.device_count()} visible on "
            f"{env.hostname}; under Slurm --gpus-per-task=1), or use --backend gloo or mpi "
            "(launcher.distributed(backend=\"gloo\") in a script of your own), which let ranks "
            "share a GPU",
        )
    if env.is_main:
        print(f"note: {shared}; NCCL cannot share a GPU, so --backend auto uses gloo",
              file=sys.stderr, flush=True)
    return "gloo"


def _gpu_identity(device: torch.device) -> str:
    """The GPU's UUID: the same card seen by two ranks, whatever index each sees it at."""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpu(env: JobEnv, store: dist.Store, gpu: str) -> str | None:
    """Collective over ``store``: which ranks on one host were bound to the same GPU.

    Each rank publishes ``gpu`` (an identity such as the UUID) under its host and local rank
    and compares it with the lower local ranks of its host; then all ranks wait for each
    other. Returns the first conflict found anywhere in the job (the same text on every
    rank), or None.
    """
    store.set(f"{_GPU_KEY}/{env.hostname}/{env.local_rank}", gpu)
    for other in range(env.local_rank):
        if store.get(f"{_GPU_KEY}/{env.hostname}/{other}").decode() == gpu:
            conflict = (f"local ranks {other} and {env.local_rank} on {env.hostname} were "
                        f"given the same GPU ({gpu})")
            store.compare_set(f"{_GPU_KEY}/conflict", "", conflict)  # the first one stays
            break
    if store.add(f"{_GPU_KEY}/checked", 1) == env.world_size:
        store.set(f"{_GPU_KEY}/all-checked", "1")
    store.wait([f"{_GPU_KEY}/all-checked"])
    key = f"{_GPU_KEY}/conflict"
    return store.get(key).decode() if store.check([key]) else None
