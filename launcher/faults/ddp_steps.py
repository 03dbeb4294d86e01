"""DDP's gradient all-reduces in the flight recorder (``launcher.faults.flight_recorder``): one
entry per backward, for every DDP, with DDP's own reducer.

DDP's reducer calls the process group from C++, past the wrapped ``torch.distributed``
functions, so a rank that never reaches backward would leave the others waiting in a call that
no recorder saw. ``install`` makes every ``DistributedDataParallel`` whose backward syncs
gradients (not under ``no_sync``) record that backward's all-reduces as one entry,
``all_reduce #N (DDP gradients)``, at the line that called backward:

- begun when the backward reaches the forward's outputs (a hook on each, the first gradient to
  arrive begins it), so a rank still in its forward, its data loader or its loss is not in it;
- ended by an autograd engine callback queued behind the reducer's own, which waits for the
  last bucket: callbacks run in the order they were queued, and one queued from a callback
  runs after every one queued during the backward.

Whoever built the DDP (``Job.wrap``, ``launcher.train``, a script's own) and with any
communication hook: nothing in Python per bucket, a few microseconds per step
(benchmarks/README.md, "Flight recorder"). Every rank records one entry per synced backward,
so the same step has the same number on every rank.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from launcher.faults import flight_recorder

NOTE = "DDP gradients"
_original_forward = None


class _Gradients:
    """What the entry records as its tensor: every gradient's bytes, the first one's dtype."""

    __slots__ = ("nbytes", "dtype")

    def __init__(self, module: torch.nn.Module):
        params = [p for p in module.parameters() if p.requires_grad]
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.dtype = params[0].dtype if params else None


def install() -> None:
    """Record the gradient all-reduces of every DDP's backward from now on (idempotent)."""
    global _original_forward
    if _original_forward is not None:
        return
    original = _original_forward = DistributedDataParallel.forward

    @functools.wraps(original)
    def forward(self, *inputs, **kwargs):
        output = original(self, *inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            _watch(self, output)
        return output

    DistributedDataParallel.forward = forward


def uninstall() -> None:
    """DDP's own forward again."""
    global _original_forward
    if _original_forward is not None:
        DistributedDataParallel.forward = _original_forward
        _original_forward = None


class _Backward:
    """One forward's backward to come: its hooks on the outputs begin the entry once."""

    __slots__ = ("group", "gradients", "begun")

    def __init__(self, group, gradients: _Gradients):
        self.group, self.gradients, self.begun = group, gradients, False

    def hook(self, _grad_outputs) -> None:
        # pre-hooks on the outputs' nodes and a flag: register_multi_grad_hook's lock, dict and
        # handles cost ~30 µs a step, tensor hooks twice a node's (launcher.train's MLP)
        if self.begun:
            return
        self.begun = True
        # the frame that called this hook is torch's (the engine's caller), where the walk to
        # the user's line starts; None in a thread of the engine's own (CUDA)
        raw = flight_recorder.begin(self.group, "all_reduce", self.gradients, NOTE,
                                    sys._getframe(0).f_back)
        engine = torch.autograd.Variable._execution_engine
        # queued now, this runs before the reducer's callback (queued when its last bucket is
        # ready); the one it queues runs after it
        engine.queue_callback(lambda: engine.queue_callback(
            lambda: flight_recorder.finish(raw, failed=False)))


def _watch(ddp: DistributedDataParallel, output) -> None:
    leaves = (output,) if isinstance(output, torch.Tensor) else tree_leaves(output)
    nodes = {leaf.grad_fn for leaf in leaves
             if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None}
    if not nodes:
        return
    gradients = ddp.__dict__.get("_ddp_recorded")
    if gradients is None:
        gradients = ddp.__dict__["_ddp_recorded"] = _Gradients(ddp.module)
    backward = _Backward(ddp.process_group, gradients)
    for node in nodes:
        node.register_prehook(backward.hook)
