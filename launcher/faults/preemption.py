"""Preemption: a signal sets a flag; all ranks agree at a step boundary to save and stop.

Schedulers warn a job before killing it (Slurm: ``--signal=USR1@90``; a requeue or ``scancel``
sends SIGTERM). The signal may reach only some ranks, so no rank acts on its own flag: at every
step boundary every rank contributes its flag to one all-reduce and all of them see the same
answer, save the same checkpoint and exit with ``EXIT_PREEMPTED`` together. The handler only
sets a flag: nothing unsafe runs inside a signal handler, and no collective is ever entered
by some ranks but not others.

Ctrl-C (SIGINT) stops the job the same way with ``EXIT_INTERRUPTED`` (130), when the ranks reach
a step boundary within ``INTERRUPT_GRACE_S``. A person is waiting, so the wait is bounded:
without a boundary by then (start-up, a long evaluation, a collective a peer never joins), and
at a second Ctrl-C, the rank ends at once with 130 and no checkpoint. Once the ranks have agreed,
the checkpoint is written at its own pace.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist

from launcher.core.defaults import PREEMPT_SIGNAL
from launcher.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, LaunchError

#: how long after Ctrl-C the ranks have to agree at a step boundary before each ends unsaved
INTERRUPT_GRACE_S = 5.0
#: what a rank contributes to the agreement; the highest wins, so Ctrl-C beats a preemption
_RUNNING, _PREEMPT, _INTERRUPT = 0, 1, 2


def nccl_clash(preempt_signal: str, nccl_dump_signal: str | None) -> str | None:
    """The warning for ``NCCL_PROXY_DUMP_SIGNAL`` set to a signal this watch catches (the
    preemption signal, SIGTERM, SIGINT): NCCL installs its own handler for it when its
    communicator starts, after this watch's, so that signal would dump NCCL's proxy state and
    stop nothing."""
    number = _c_integer(nccl_dump_signal or "")
    caught = (getattr(signal, f"SIG{preempt_signal}"), signal.SIGTERM, signal.SIGINT)
    clash = next((caught_number for caught_number in caught if caught_number == number), None)
    if clash is None:
        return None
    other = "USR1" if clash == signal.SIGUSR2 else "USR2"
    instead = "" if clash != caught[0] else (
        f", or preempt with another (DDP_PREEMPT_SIGNAL={other} and "
        f"sbatch --signal={other}@120)")
    return (f"NCCL_PROXY_DUMP_SIGNAL={nccl_dump_signal} is {clash.name}, a signal that tells "
            "this job to save and stop: NCCL takes it over, and it would stop nothing; unset "
            f"NCCL_PROXY_DUMP_SIGNAL or give it another signal{instead}")


def _c_integer(text: str) -> int | None:
    """``text`` read as C's ``strtoll(text, NULL, 0)`` reads a whole number (NCCL's
    parameters): decimal, ``0x`` hexadecimal, a leading ``0`` octal; None for anything else."""
    text = text.strip()
    try:
        return int(text, 8) if len(text) > 1 and text[0] == "0" and text.isdigit() \
            else int(text, 0)
    except ValueError:
        return None


class PreemptionWatch:
    """Catches the preemption signal, SIGTERM and SIGINT while active (a context manager)."""

    def __init__(self, signal_name: str = PREEMPT_SIGNAL, rank: int | None = None):
        name = signal_name.upper().removeprefix("SIG")
        number = getattr(signal, f"SIG{name}", None)
        if not isinstance(number, signal.Signals):
            raise LaunchError(f"unknown preemption signal {signal_name!r}",
                              hint="set DDP_PREEMPT_SIGNAL to a signal name such as USR1, USR2 "
                              "or TERM")
        self.signals = sorted({number, signal.SIGTERM})
        self.received: signal.Signals | None = None
        self.interrupted = False
        #: the exit status the ranks agreed on: None while running
        self.stop_status: int | None = None
        self._prefix = "" if rank is None else f"[rank {rank}] "
        self._deadline: threading.Timer | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup = -1

    def __enter__(self) -> PreemptionWatch:
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, _ignore)
        # Ctrl-C is seen by a thread: a Python handler runs only when the main thread runs
        # Python, never while it sits in a collective; the C handler writes to this socket
        reader, writer = self._wakeup = socket.socketpair()
        writer.setblocking(False)
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch_interrupts, args=(reader,), name="ddp-ctrl-c",
                         daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        signal.set_wakeup_fd(self._previous_wakeup)
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        self._wakeup[1].close()  # the watching thread reads the end and stops

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def _watch_interrupts(self, reader: socket.socket) -> None:
        with reader:
            while data := reader.recv(64):
                for _ in range(data.count(signal.SIGINT)):
                    self._interrupt()

    def _interrupt(self) -> None:
        if self.interrupted:
            self._end("a second Ctrl-C")
        self.interrupted = True
        self._deadline = threading.Timer(
            INTERRUPT_GRACE_S, self._end,
            [f"no step boundary within {INTERRUPT_GRACE_S:g} s of Ctrl-C"])
        self._deadline.daemon = True
        self._deadline.start()

    def _end(self, why: str) -> None:
        print(f"{self._prefix}interrupted ({why}), no checkpoint saved: exit {EXIT_INTERRUPTED}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        # every rank got the signal and ends the same way: nothing to abort, nothing to wait for
        os._exit(EXIT_INTERRUPTED)

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank has received a signal; then
        ``stop_status`` says how the ranks end (130 when any rank saw Ctrl-C, else 75)."""
        local = _INTERRUPT if self.interrupted else _RUNNING if self.received is None else _PREEMPT
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        if local == _INTERRUPT and self._deadline is not None:
            self._deadline.cancel()  # agreed in time: the checkpoint may take what it takes
        self.stop_status = {_RUNNING: None, _PREEMPT: EXIT_PREEMPTED,
                            _INTERRUPT: EXIT_INTERRUPTED}[local]
        return local != _RUNNING


def _ignore(signum: int, frame: FrameType | None) -> None:
    """SIGINT's Python handler: the watching thread acts on it (no KeyboardInterrupt)."""
