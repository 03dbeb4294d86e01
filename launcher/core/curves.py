"""Curves for TensorBoard: rank 0's scalars in ``RUN_DIR/tensorboard``, one point per step.

Each attempt of a run (the first, each requeue, each resume, on any world size) writes a file
of its own; steps are optimizer steps, which a resume continues whatever the world size. An
attempt that resumes from a checkpoint older than the last logged step (a crash, a lost
node) would log those steps a second time, so its first point purges every point of earlier
files at that step or later (TensorBoard's own rule for a restarted run): each file is
rewritten without them, atomically, once per attempt. A reader thus sees each step once.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from launcher.core import event_file
from launcher.core.atomic import write_atomic
from launcher.core.event_file import Event

#: TensorBoard finds event files by this part of their name
PREFIX = "events.out.tfevents."
#: what launcher.train's metrics records hold that is not a curve
_NOT_CURVES = {"event", "step", "epoch", "time"}
#: the tag group of each kind of record
_GROUPS = {"step": "train", "eval": "eval"}
_sequence = itertools.count()


class Curves:
    """Scalars by step into ``directory``; a no-op on every rank but the main one."""

    def __init__(self, directory: Path, is_main: bool):
        self.directory = directory
        self.is_main = is_main
        self._file = None

    def log(self, step: int, **values: float) -> None:
        """Scalars ``values`` (tag -> number) at ``step``; the tags may hold ``/`` for groups."""
        if not self.is_main or not values:
            return
        if self._file is None:
            self._open(step)
        event = Event(time.time(), int(step), tuple((tag, float(v)) for tag, v in values.items()))
        self._file.write(event_file.record(event_file.encode(event)))
        self._file.flush()  # the job may be killed at any moment: what is written stays

    def log_record(self, record: dict) -> None:
        """A metrics record of launcher.train: ``{"event": "step", "step": 5, "loss": ...}``
        as ``train/loss`` and so on (``eval/test_accuracy`` for an evaluation)."""
        group = _GROUPS.get(record.get("event"), "metrics")
        self.log(record["step"], **{f"{group}/{key}": value for key, value in record.items()
                                    if key not in _NOT_CURVES
                                    and isinstance(value, int | float)})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self, first_step: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob(f"{PREFIX}*")):
            purge(path, first_step)
        # sorted by name = by attempt: the time first, then a count within this process
        name = (f"{PREFIX}{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
                f".{next(_sequence)}")
        self._file = (self.directory / name).open("wb")
        self._file.write(event_file.record(event_file.encode(
            Event(time.time(), version=event_file.FILE_VERSION))))


def purge(path: Path, first_step: int) -> None:
    """Rewrite the event file ``path`` without its points at ``first_step`` or later, and
    without a torn last record; left as it is when there is nothing to drop."""
    data = path.read_bytes()
    kept = [r for r in event_file.records(data)
            if (event := event_file.decode(r)).step is None or event.step < first_step]
    text = b"".join(event_file.record(r) for r in kept)
    if text != data:
        write_atomic(path, text)


def read_curves(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every tag's points (step, value) in ``directory``'s event files, in file order."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob(f"{PREFIX}*")):
        for event in event_file.read_events(path.read_bytes()):
            for tag, value in event.values:
                curves.setdefault(tag, []).append((event.step, value))
    return curves
