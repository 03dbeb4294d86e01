"""``python -m launcher.hang DIR``: a hung job's post-mortem read again (``launcher.faults.
hang_watch`` wrote it): the diagnosis line, then one row per rank (where it was, its call).

DIR is the run directory or its ``hang/`` (or the directory the line named, for a script
without one). Each rank's ``rank-R.json`` holds what it said of itself; ``rank-R.txt`` its
stacks and last calls, for people. Only the rank files of the look that ``diagnosis.txt`` was
decided from are read (``launcher.faults.hang_files``): a job requeued or resumed into the same
run directory, with fewer ranks maybe, leaves an earlier attempt's files there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launcher.core.errors import LaunchError, report_and_exit
from launcher.faults import hang_files
from launcher.faults.hang_diagnosis import Where, diagnose


def hang_directory(directory: Path) -> Path:
    """The hang directory of ``directory``: itself, or its ``hang/`` (a run directory)."""
    return directory / "hang" if (directory / "hang").is_dir() else directory


def read(directory: Path, look: str | None = None) -> list[Where]:
    """The ranks' places from ``directory``, a hang directory: of ``look`` only, unless None
    (files written before looks had ids)."""
    wheres = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
            if look is None or data.get(hang_files.LOOK) == look:
                wheres.append(Where.from_dict(data["where"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LaunchError(f"cannot read {path}: {exc}",
                              hint="the file is damaged; the other ranks' files and the "
                              "rank-R.txt files still tell") from None
    if not wheres:
        raise LaunchError(f"no hang post-mortem in {directory} (no rank-*.json"
                          f"{'' if look is None else ' of look ' + look})",
                          hint="give the run directory of a job that ended with exit 4, or "
                          "the directory its 'hang:' line named")
    return sorted(wheres, key=lambda w: w.rank)


def table(wheres: list[Where]) -> str:
    rows = [("rank", "node", "state", "call", "at")]
    for w in wheres:
        call = (f"{w.call['op']} #{w.call['seq']} at {w.call['where']} ({w.call['state']})"
                if w.call else "-")
        rows.append((str(w.rank), w.node, w.kind, call, f"{w.at} in {w.function}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in
                               zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.hang",
                                     description="Print a hung job's diagnosis again, with "
                                     "where each rank was.")
    parser.add_argument("directory", type=Path, help="the run directory, or its hang/")
    args = parser.parse_args(argv)
    directory = hang_directory(args.directory)
    line, look = hang_files.diagnosis(directory) or (None, None)
    try:
        wheres = read(directory, look)
    except LaunchError as error:
        report_and_exit(error)
    line = line or diagnose(wheres) or ("no hang: every rank waits in the same call "
                                        "(a long call, not ranks that do not meet)")
    print(line)
    print()
    print(table(wheres))
    sys.stdout.flush()
    return 0
