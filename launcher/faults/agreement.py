"""Ranks agree on an error only some of them saw: one context manager, used wherever that can be.

    with agree():
        ...  # may raise LaunchError on some ranks only

Collective: every rank enters and leaves it. On the way out the ranks exchange one flag; if the
body raised a LaunchError on any rank, every rank raises one: the ranks that failed their own,
the others ``rank N failed: <its message>`` with its HINT. So a corrupt file on one node's
local disk, or rank 0 failing to write a checkpoint, stops every rank with exit 2 and the same
cause, instead of leaving the others in their next collective until the timeout. The raised
errors are marked ``everywhere`` (``launcher.core.errors.raised_everywhere``): nobody needs to be
told of them again. Other exceptions are not caught: they are bugs, not inputs, and reach every
rank through ``launcher.faults.failfast``.

A leaf module below the process group: data and checkpoint code use it without importing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from launcher.core.errors import LaunchError
from launcher.faults import flight_recorder, heartbeat


@contextmanager
def agree() -> Iterator[None]:
    """Collective: a LaunchError raised in the body on any rank is raised on every rank."""
    error: LaunchError | None = None
    # the ranks wait for each other here by design (rank 0 writing a checkpoint): busy, not hung
    with flight_recorder.working():
        try:
            yield
        except LaunchError as exc:
            error = exc
        _settle(error)


def _settle(error: LaunchError | None) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise _everywhere(error)
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_comm_device())
    _max(flag)
    if int(flag.item()) == 0:
        return
    messages: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else (error.message, error.hint))
    if error is not None:
        raise _everywhere(error)
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    ranks = ", ".join(str(rank) for rank, _ in failed)
    first_message, first_hint = failed[0][1]
    raise _everywhere(LaunchError(f"rank {ranks} failed: {first_message}", hint=first_hint))


def _max(flag: torch.Tensor) -> None:
    """The ranks meet here while one writes a checkpoint or evaluates: past the group's
    timeout the wait goes on while every peer still beats (``launcher.faults.heartbeat``). gloo
    times a collective out by itself, so it gets BUSY_LIMIT times the timeout here; the mpi backend
    asks the heartbeats in every wait; NCCL keeps its own timeout."""
    if dist.get_backend() != "gloo" or not heartbeat.watching():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return
    group = distributed_c10d._get_default_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.timeout = timeout * heartbeat.BUSY_LIMIT
    work = group.allreduce([flag], opts)
    heartbeat.wait_busy(work.is_completed, timeout.total_seconds(), "the ranks' agreement",
                        dist.get_rank())
    work.wait()  # raises what failed it


def _everywhere(error: LaunchError) -> LaunchError:
    error.everywhere = True
    return error


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
