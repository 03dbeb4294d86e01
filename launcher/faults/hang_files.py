"""The hang directory's per-rank files (``launcher.faults.hang_watch`` writes them when rank 0
asks where each rank is; ``python -m launcher.hang`` reads them again): ``rank-R.json`` for
programs, ``rank-R.txt`` for people."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.core.atomic import write_atomic
from launcher.faults import flight_recorder
from launcher.faults.hang_diagnosis import Where


def write(directory: Path, where: Where, threads: str, mine: bool = True) -> None:
    """``rank-R.json`` (where, and the whole recorder when it is this rank's) and
    ``rank-R.txt`` (the stacks and the calls, for people)."""
    calls = flight_recorder.snapshot() if mine else []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        data = {"where": where.to_dict(), "calls": calls}
        write_atomic(directory / f"rank-{where.rank}.json", json.dumps(data, indent=1).encode())
        table = "\n".join(f"  {c['group']} #{c['seq']} {c['op']}{_note(c)}{_size(c)} "
                          f"at {c['where']}: {c['state']}" for c in calls)
        text = (f"rank {where.rank} ({where.node}): {where.kind}, at {where.at} in "
                f"{where.function}\n\nlast calls:\n{table or '  (none)'}\n\nstacks:\n{threads}")
        write_atomic(directory / f"rank-{where.rank}.txt", text.encode())
    except OSError as exc:  # the line still goes out: it names what could not be written
        print(f"[rank {where.rank}] warning: cannot write {directory}: {exc}", file=sys.stderr,
              flush=True)


def _note(call: dict) -> str:
    return f" ({call['note']})" if call.get("note") else ""


def _size(call: dict) -> str:
    return "" if call["nbytes"] is None else f" {call['nbytes']} B {call['dtype']}"
