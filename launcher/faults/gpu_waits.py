"""nccl's waits: its collectives return at once and finish on the GPU, so no call of this
process waits past its timeout and asks the heartbeats, as the other backends' waits do
(``launcher.faults.heartbeat.overdue``). A thread asks for them.

Every beat it takes the call this rank waits in: the oldest recorded call whose kernel has not
finished (``flight_recorder.current``), else one still under way on the CPU (NCCL sets
its communicator up in the first call). Past the timeout it hands that call to ``overdue`` as a
wait of its own would: a silent peer ends this rank naming it (exit 3), ranks alive but not
meeting go to the hang watch (one line on every rank, exit 4), a long call on every rank is
waited for up to ``BUSY_LIMIT`` times the timeout. NCCL's own watchdog, which would end the
process at the timeout with no name, gets ``BUSY_LIMIT + 1`` times it
(``launcher.group.process_group``). Per rank: a few event queries a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from launcher.core.errors import PeerLost
from launcher.faults import flight_recorder, heartbeat
from launcher.faults.record_entry import ON_GPU, Entry


class GpuWaits:
    """The thread; ``lost``: how this rank ends for a lost peer (it does not return)."""

    def __init__(self, timeout_s: float, rank: int, lost: Callable[[PeerLost], None]):
        self._timeout_s, self._rank, self._lost = timeout_s, rank, lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddp-gpu-waits", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(heartbeat.BEAT_S):
            found = waiting()
            if found is None or found[1] <= self._timeout_s:
                continue
            entry, waited = found
            try:
                on = " on the GPU" if entry.state == ON_GPU else ""
                heartbeat.overdue(f"{entry.op}{on}", waited, self._timeout_s, self._rank)
            except PeerLost as lost:
                self._lost(lost)
                return

    def stop(self) -> None:
        self._stop.set()


def waiting() -> tuple[Entry, float] | None:
    """The call this rank waits in (``flight_recorder.current``: the oldest one on the GPU
    first) and for how many seconds, or None."""
    entry = flight_recorder.current()
    if entry is None or entry.state not in (ON_GPU, "running"):
        return None
    since = entry.end_ns if entry.state == ON_GPU else entry.start_ns
    return entry, (time.monotonic_ns() - since) / 1e9
