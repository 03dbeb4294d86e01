"""DDP's gradient all-reduces in the flight recorder (``launcher.faults.flight_recorder``): one
entry per backward, for every DDP, with DDP's own reducer.

DDP's reducer calls the process group from C++, past the wrapped ``torch.distributed``
functions, so a rank that never reaches backward would leave the others waiting in a call that
no recorder saw. ``install`` makes every ``DistributedDataParallel`` whose forward syncs
gradients (grad enabled, not under ``no_sync``) record the backward that follows as one entry,
``all_reduce #N (DDP gradients)``, at the line that called backward:

- the forward only marks its DDP as due (no hook on the graph: a Python pre-hook that the
  engine called in backward and two engine callbacks to end the entry cost about twice as much,
  benchmarks/README.md);
- ``torch.autograd.backward`` (which ``Tensor.backward`` calls) begins the due DDPs' entries
  and ends them when it returns: by then DDP's reducer has every bucket back, since it waits
  for them in a callback that the engine runs before backward returns. A rank still in its
  forward, its data loader or its loss has not begun it.

Whoever built the DDP (``Job.wrap``, ``launcher.train``, a script's own) and with any
communication hook: nothing in Python per bucket, a few microseconds per step
(benchmarks/README.md, "Flight recorder"). Every rank records one entry per synced backward,
so the same step has the same number on every rank. A backward that does not reach a due DDP's
outputs (a loss that never used them) is recorded for it all the same, on every rank alike.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.faults import flight_recorder

NOTE = "DDP gradients"
_originals: dict[str, object] = {}
#: the DDPs whose forward synced and whose backward is still to come: id -> weak reference
_due: dict[int, weakref.ref] = {}


class _Recorded:
    """What a DDP's entries record as their tensor (every gradient's bytes, the first one's
    dtype) and the ring they go to, found once per DDP and recorder: a backward runs its
    recording cold (the caches full of the forward's tensors), where each Python call saved
    counts (benchmarks/README.md, "Flight recorder")."""

    __slots__ = ("nbytes", "dtype", "ring")

    def __init__(self, ddp: DistributedDataParallel):
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.dtype = params[0].dtype if params else None
        self.ring = flight_recorder.ring_of(ddp.process_group)


def install() -> None:
    """Record the gradient all-reduces of every DDP's backward from now on (idempotent)."""
    if _originals:
        return
    forward = _originals["forward"] = DistributedDataParallel.forward
    backward = _originals["backward"] = torch.autograd.backward

    @functools.wraps(forward)
    def due_forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            _due[id(self)] = weakref.ref(self)
        return forward(self, *inputs, **kwargs)

    @functools.wraps(backward)
    def recorded_backward(*args, **kwargs):
        if not _due:
            return backward(*args, **kwargs)
        raws = _begin(sys._getframe(1))
        try:
            result = backward(*args, **kwargs)
        except BaseException:
            for raw in raws:
                flight_recorder.finish(raw, failed=True)
            raise
        for raw in raws:
            flight_recorder.finish(raw, failed=False)
        return result

    DistributedDataParallel.forward = due_forward
    torch.autograd.backward = recorded_backward


def uninstall() -> None:
    """DDP's and autograd's own functions again."""
    if _originals:
        DistributedDataParallel.forward = _originals.pop("forward")
        torch.autograd.backward = _originals.pop("backward")
    _due.clear()


def _begin(frame) -> list[list]:
    """One entry begun for each due DDP, at the first frame outside torch from ``frame``."""
    raws = []
    for ref in list(_due.values()):
        ddp = ref()
        if ddp is None:
            continue
        recorded = ddp.__dict__.get("_ddp_record")
        if recorded is None or not recorded.ring.live:
            recorded = ddp.__dict__["_ddp_record"] = _Recorded(ddp)
        raws.append(flight_recorder.begin(recorded.ring, "all_reduce", recorded, NOTE, frame))
    _due.clear()
    return raws
