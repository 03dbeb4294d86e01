"""DDP's gradient all-reduces in the flight recorder (``launcher.faults.flight_recorder``).

DDP's reducer calls the process group from C++, past the wrapped ``torch.distributed``
functions, so a rank that never reaches backward would leave the others waiting in a call that
no recorder saw. ``allreduce`` is a DDP communication hook that does what the reducer does
without one (multiply the bucket by 1/size, sum it over the group) and records each bucket as
``all_reduce #N (DDP bucket k)``, from the line that called backward, ended when its result is
ready. The models the launcher wraps get it (``Job.wrap``, ``launcher.train``); it costs what
torch's own Python hook costs: on CPU one pass over the gradients and a few hand-overs of the
GIL per bucket, ~0.1 ms on a 1 ms step of a small MLP (benchmarks/README.md). The weights
stay bit-identical to DDP's own reducer's (tests/test_flight_recorder.py, 3 ranks); torch's
``default_hooks.allreduce_hook`` divides by the size instead, which differs in the last bit
where the size is not a power of 2.

The mpi4py backend (``launcher.mpi``) records nothing itself: its calls are recorded here and
by the wrapped functions, like gloo's and nccl's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from launcher.faults import flight_recorder


def allreduce(group, bucket):
    """The hook, ``ddp.register_comm_hook(group, allreduce)`` (None: the default group):
    takes a ``dist.GradBucket``, returns a ``Future[Tensor]`` (unannotated: DDP checks the
    annotation objects, which postponed annotations would turn into strings)."""
    group = dist.group.WORLD if group is None else group
    tensor = bucket.buffer()
    raw = flight_recorder.begin(group, "all_reduce", tensor, f"DDP bucket {bucket.index()}")
    try:
        tensor.mul_(1 / group.size())
        work = flight_recorder.original("all_reduce")(tensor, group=group, async_op=True)
    except BaseException:
        flight_recorder.finish(raw, failed=True)
        raise

    def ready(future: torch.futures.Future) -> torch.Tensor:
        try:
            value = future.value()[0]
        except BaseException:  # the group failed or timed out: where this rank waited
            flight_recorder.finish(raw, failed=True)
            raise
        flight_recorder.finish(raw, failed=False)
        return value

    return work.get_future().then(ready)
