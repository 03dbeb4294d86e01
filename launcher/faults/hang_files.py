"""The hang directory's files (``launcher.faults.hang_watch`` writes them when rank 0 asks where
each rank is; ``python -m launcher.hang`` reads them again): per rank ``rank-R.json`` for
programs and ``rank-R.txt`` for people, and rank 0's ``diagnosis.txt``, the line.

A run directory's ``hang/`` outlives the job: a requeued or resumed job writes into it again,
with other ranks, maybe fewer. So each look (one round of asking) has an id that its files
carry, and a reader keeps the rank files of the look that ``diagnosis.txt`` names. Standard
library only, as ``launcher.faults.hang_diagnosis``: the reader runs anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.core.atomic import write_atomic
from launcher.faults.hang_diagnosis import Where

DIAGNOSIS_FILE = "diagnosis.txt"
#: the key of a rank file's look id, and the line of ``diagnosis.txt`` that names its look
LOOK = "look"
_LOOK_LINE = f"{LOOK}: "


def write(directory: Path, look: str, where: Where, threads: str,
          calls: list[dict] | None = None) -> None:
    """``rank-R.json`` (where, and ``calls``, the whole recorder when it is this rank's) and
    ``rank-R.txt`` (the stacks and the calls, for people), both of ``look``."""
    calls = calls or []
    data = {LOOK: look, "where": where.to_dict(), "calls": calls}
    table = "\n".join(f"  {c['group']} #{c['seq']} {c['op']}{_note(c)}{_size(c)} "
                      f"at {c['where']}: {c['state']}" for c in calls)
    text = (f"rank {where.rank} ({where.node}): {where.kind}, at {where.at} in "
            f"{where.function} [{LOOK} {look}]\n\nlast calls:\n{table or '  (none)'}\n\n"
            f"stacks:\n{threads}")
    _write(directory, where.rank, {f"rank-{where.rank}.json": json.dumps(data, indent=1),
                                   f"rank-{where.rank}.txt": text})


def write_diagnosis(directory: Path, look: str, line: str) -> None:
    """``diagnosis.txt``: the line, and the look whose rank files it was decided from."""
    _write(directory, 0, {DIAGNOSIS_FILE: f"{line}\n{_LOOK_LINE}{look}\n"})


def diagnosis(directory: Path) -> tuple[str, str | None] | None:
    """The line of ``directory``'s ``diagnosis.txt`` and its look (None: written before looks
    had ids); None without one (no line was decided there)."""
    try:
        lines = (directory / DIAGNOSIS_FILE).read_text().splitlines()
    except OSError:
        return None
    looks = [line.removeprefix(_LOOK_LINE) for line in lines[1:] if line.startswith(_LOOK_LINE)]
    return (lines[0] if lines else ""), (looks[0] if looks else None)


def _write(directory: Path, rank: int, files: dict[str, str]) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            write_atomic(directory / name, text.encode())
    except OSError as exc:  # the line still goes out: it names what could not be written
        print(f"[rank {rank}] warning: cannot write {directory}: {exc}", file=sys.stderr,
              flush=True)


def _note(call: dict) -> str:
    return f" ({call['note']})" if call.get("note") else ""


def _size(call: dict) -> str:
    return "" if call["nbytes"] is None else f" {call['nbytes']} B {call['dtype']}"
