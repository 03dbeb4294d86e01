"""A run directory's ``metrics.jsonl`` read back: the records of launcher.train, one per step.

A run that was preempted or lost a node resumes from its last checkpoint and logs the steps
after it again; the later record of a step is the one the finished model followed, so each
step keeps its last record. A line the writer did not finish (the job was killed mid-write)
is skipped. ``invoke sweep-summary`` and ``invoke plot`` read runs through here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ddp_tasks.sweep import parse_config_name
from launcher.core.errors import LaunchError

METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class Run:
    """One run directory's records by event ("step", "eval"), each ordered by step."""

    path: Path
    #: the sweep's values when the directory is a sweep task's (lr=0.1,...), else ()
    config: tuple[tuple[str, str], ...]
    events: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.path.name if self.config else str(self.path)

    def last(self, event: str) -> dict:
        records = self.events.get(event, [])
        return records[-1] if records else {}


def read_run(path: Path) -> Run:
    """The run in ``path``; a LaunchError when it has no metrics."""
    metrics = path / METRICS
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise LaunchError(f"cannot read {metrics}: {exc.strerror}",
                          hint="pass a run directory of launcher.train (its --run-dir)") from None
    by_step: dict[str, dict[int, dict]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step.setdefault(str(record.get("event")), {})[record["step"]] = record
    events = {event: [steps[s] for s in sorted(steps)] for event, steps in by_step.items()}
    return Run(path, parse_config_name(path.name) or (), events)


def read_runs(paths: list[Path]) -> list[Run]:
    """Each path a run, or a sweep's root: then each of its tasks' run directories, in the
    sweep's order of values (numbers as numbers)."""
    runs = []
    for path in paths:
        if (path / METRICS).exists():
            runs.append(read_run(path))
            continue
        tasks = [d for d in path.iterdir() if (d / METRICS).exists()] if path.is_dir() else []
        if not tasks:
            raise LaunchError(f"{path} holds no {METRICS}, nor run directories with one",
                              hint="pass the --run-dir of a launcher.train run, or of an "
                              "invoke sbatch --sweep (its tasks' directories are inside)")
        runs += sorted((read_run(d) for d in tasks), key=_order)
    return runs


def _order(run: Run) -> tuple:
    def key(value: str):
        try:
            return (0, float(value), "")
        except ValueError:
            return (1, 0.0, value)
    return tuple(key(value) for _, value in run.config) or ((1, 0.0, run.path.name),)
