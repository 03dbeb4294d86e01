"""How ranks keep one model: DDP with a timed all-reduce hook, or synchronous SGD by hand.

Both give the same weights (``--sync ddp|manual``). Buffers are the subtle part: batch norm's
running statistics may drift apart between ranks during training and follow rank 0 before an
evaluation (``reads_buffers_in_training``), any other buffer follows rank 0 every step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.faults import flight_recorder


def wrap_for_sync(module: nn.Module, sync: str, device: torch.device, comm_seconds: list[float],
                  buffers_every_step: bool) -> nn.Module:
    """Collective: what the training step calls. ``ddp``: the DDP wrapper, its all-reduces
    timed into ``comm_seconds``; ``manual``: the module itself, with rank 0's weights."""
    if sync == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids)
        # an attribute, not the keyword: torch 2.13 deprecates broadcast_buffers= for
        # forward_sync_buffers=, which older versions lack; both read this attribute
        ddp.broadcast_buffers = buffers_every_step
        ddp.register_comm_hook(comm_seconds, timed_allreduce)
        return ddp
    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=0)
    return module


#: layers whose buffers (running statistics) a training forward updates but never reads
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def reads_buffers_in_training(module: nn.Module) -> bool:
    """Whether a training forward may read a buffer that ranks could hold differently.

    Batch norm in training mode normalises with the batch's own statistics and only updates its
    running ones, which nothing reads until evaluation (and a frozen batch norm in eval mode
    never changes them). So ranks may let those drift apart during training and take rank 0's
    before evaluating; rank 0's are what a checkpoint holds either way. That saves DDP's
    broadcast before every forward: a collective and a point where the faster rank waits
    (measured: weak-scaling efficiency 0.81 -> 0.85 with gloo on 16 cores, see
    benchmarks/README.md). Any other buffer might be read, and follows rank 0 every step.
    """
    return any(not isinstance(m, _BATCH_NORMS) and next(m.buffers(recurse=False), None) is not None
               for m in module.modules())


def timed_allreduce(seconds: list[float], bucket):
    """What DDP's reducer does with a bucket (scale by 1/size, sum over the group), timed from
    launch until the result is ready. Recorded once per backward, as any DDP's
    (``launcher.faults.ddp_steps``), so the all-reduce itself is the unrecorded one."""
    # takes a dist.GradBucket, returns a Future[Tensor]; unannotated because DDP checks the
    # annotation objects themselves, and postponed annotations would turn them into strings
    start = time.perf_counter()
    tensor = bucket.buffer()
    # multiplied, as the reducer does: torch's allreduce_hook divides, and differs from DDP
    # in the last bit where the size is not a power of 2
    tensor.mul_(1 / dist.get_world_size())
    work = flight_recorder.original("all_reduce")(tensor, async_op=True)

    def done(future: torch.futures.Future) -> torch.Tensor:
        seconds[0] += time.perf_counter() - start
        return future.value()[0]

    return work.get_future().then(done)


def allreduce_gradients(module: nn.Module) -> None:
    """Synchronous SGD by hand: one all-reduce of all gradients, then divide by world size."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def buffers_follow_rank_0(module: nn.Module) -> None:
    """Collective: every rank takes rank 0's buffers (batch norm's running statistics)."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)
