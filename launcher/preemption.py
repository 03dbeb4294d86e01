"""Preemption: a signal sets a flag; all ranks agree at a step boundary to save and stop.

Schedulers warn a job before killing it (Slurm: ``--signal=USR1@90``; a requeue or ``scancel``
sends SIGTERM). The signal may reach only some ranks, so no rank acts on its own flag: at every
step boundary every rank contributes its flag to one all-reduce and all of them see the same
answer, save the same checkpoint and exit with ``EXIT_PREEMPTED`` together. The handler only
sets a flag: nothing unsafe runs inside a signal handler, and no collective is ever entered
by some ranks but not others.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from launcher.errors import LaunchError


class Preempted(Exception):
    """Raised once the ranks have agreed to stop and the checkpoint is written."""

    #: on every rank at once (``launcher.errors.raised_everywhere``)
    everywhere = True

    def __init__(self, checkpoint: str):
        super().__init__(f"preempted; checkpoint {checkpoint}")
        self.checkpoint = checkpoint


class PreemptionWatch:
    """Catches the preemption signal and SIGTERM while active (a context manager)."""

    def __init__(self, signal_name: str = "USR1"):
        name = signal_name.upper().removeprefix("SIG")
        number = getattr(signal, f"SIG{name}", None)
        if not isinstance(number, signal.Signals):
            raise LaunchError(f"unknown preemption signal {signal_name!r}",
                              hint="set DDP_PREEMPT_SIGNAL to a signal name such as USR1, USR2 "
                              "or TERM")
        self.signals = sorted({number, signal.SIGTERM})
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> PreemptionWatch:
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank has received a signal."""
        local = 0 if self.received is None else 1
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return bool(local)
        flag = torch.tensor([local], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
