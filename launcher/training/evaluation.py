"""Evaluation on the held-out split, and the autocast context a precision asks for."""

from __future__ import annotations

import torch
import torch.distributed as dist

from launcher.placement.env import JobEnv
from launcher.training.data import Split
from launcher.training.gradient_sync import buffers_follow_rank_0
from launcher.training.models import ModelSpec

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """torch.autocast for ``--precision`` (off for fp32)."""
    dtype = _AUTOCAST.get(precision)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


@torch.no_grad()
def evaluate(spec: ModelSpec, test: Split, env: JobEnv, device: torch.device,
             precision: str) -> dict[str, float]:
    """Collective: loss (and accuracy, for a classifier) on ``test``, each rank taking every
    world-size-th sample, summed over all ranks. Every rank evaluates with rank 0's buffers:
    the model a checkpoint holds."""
    module = spec.module
    if env.is_distributed:
        buffers_follow_rank_0(module)
    module.eval()
    idx = torch.arange(env.rank, len(test), env.world_size)
    # loss x samples, right predictions, samples, predictions
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for chunk in idx.split(256):
        inputs = test.inputs[chunk].to(device)
        targets = test.targets[chunk].to(device)
        with autocast(device, precision):
            out = module(inputs).float()
        sums[0] += spec.loss(out, inputs, targets).double() * len(chunk)
        sums[2] += len(chunk)
        correct = spec.correct(out, targets)
        if correct is not None:
            sums[1] += correct[0]
            sums[3] += correct[1]
    module.train()
    if env.is_distributed:
        dist.all_reduce(sums)
    result = {"test_loss": sums[0].item() / sums[2].item()}
    if spec.task == "classify":
        result["test_accuracy"] = sums[1].item() / sums[3].item()
    return result
