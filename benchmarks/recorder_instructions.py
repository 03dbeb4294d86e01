"""What the flight recorder costs, counted in instructions under valgrind's callgrind.

    .venv/bin/python -m benchmarks.recorder_instructions --cache-sim \
        --json benchmarks/results/recorder_instructions.json

``benchmarks.flight_recorder`` times the recorder, and on a shared VM its times cannot resolve
2 % of a step: two identical columns there differ by as much as the recorder costs. This runs
the same measurements (the wrapper alone, a 4 KiB ``all_reduce``, the DDP step, the step with
torch's hook) under callgrind, which counts what the CPU executes, and load from elsewhere
does not change that count. A mode's calls run inside one ``functools.reduce`` and nothing else
does, so callgrind dumps its counts on entering and on leaving it (``--dump-before`` and
``--dump-after=functools_reduce``): the second dump holds those calls alone, every thread's
instructions included (gloo's worker too). Each round runs "without", "with" and "without"
again; what the two "without" runs differ by is the count's own noise (the A/A column).

Instructions are not time: a cache miss or a mispredicted branch costs more than an
instruction. ``--cache-sim`` has callgrind simulate the caches and branches too and gives its
cycle estimate (KCachegrind's: Ir + 10 Bm + 10 L1m + 100 LLm), a model of time from the same
counts, about twice as slow to run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import plots

REPO = Path(__file__).resolve().parents[1]
# each round's runs: name -> the recorder's mode (benchmarks.flight_recorder's), "without" twice
MODES = {"without": "without", "with": "with", "without, again": "without"}
MARKER = "functools_reduce"  # the C function of functools.reduce in CPython


def callgrind_command(out: Path, cache_sim: bool) -> list[str]:
    # instrumented only once the measurements are set up (instrument_from_here): importing torch
    # under callgrind takes a minute, uninstrumented a few seconds
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--dump-before={MARKER}", f"--dump-after={MARKER}",
            f"--callgrind-out-file={out}/callgrind.%p",
            *(["--cache-sim=yes", "--branch-sim=yes"] if cache_sim else [])]


def totals(dump: Path) -> dict[str, int]:
    """Event -> count over a callgrind dump (its ``events:`` and ``totals:``/``summary:``
    lines)."""
    events, counts = [], []
    for line in dump.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            counts = [int(c) for c in line.split()[1:]]
    return dict(zip(events, counts + [0] * (len(events) - len(counts)), strict=True))


def cycles(counts: dict[str, int]) -> int | None:
    """KCachegrind's cycle estimate, where the caches and branches were simulated."""
    if "Bcm" not in counts:
        return None
    first = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    last = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * (counts["Bcm"] + counts["Bim"]) + 10 * first + 100 * last


def instrument_from_here() -> None:
    """callgrind counts from now on (callgrind_control answers once it has)."""
    asked = subprocess.run(["callgrind_control", "--instr=on", str(os.getpid())],
                           capture_output=True, text=True)
    said = (asked.stdout + asked.stderr).strip().splitlines() or ["no answer"]
    if asked.returncode or said[0].startswith("Error"):  # it exits 0 when no callgrind answers
        sys.exit(f"error: callgrind_control could not turn counting on: {said[0]}\n"
                 "HINT: run this module without --inside: it starts callgrind itself")


def run_counted(op, calls: int, out: Path) -> Path:
    """Run ``op`` ``calls`` times inside the marker; the dump callgrind wrote on leaving it."""
    before = set(out.iterdir())
    functools.reduce(lambda _acc, _index: op(), range(calls), None)
    written = sorted(set(out.iterdir()) - before, key=lambda p: int(p.suffix[1:]))
    if len(written) != 2:
        sys.exit(f"error: callgrind wrote {len(written)} dumps around {MARKER}, not 2\n"
                 "HINT: run this module without --inside (it starts callgrind itself); a "
                 "stripped Python has no symbol to dump on")
    return written[-1]


def inside(out: Path, steps: int, rounds: int, only: list[str]) -> None:
    """The measurements, run under callgrind: out/runs.json maps measure -> mode -> the dump of
    each round."""
    # here, not at the top: the parent only starts callgrind and reads its dumps, without torch
    import torch
    import torch.distributed as dist

    from benchmarks import flight_recorder as timed
    from launcher.placement.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    recorders = {"without": None, "with": timed.Recording}
    runs: dict[str, dict] = {}
    try:
        measures = {name: measure for name, measure in timed.contenders(recorders).items()
                    if not only or name in only}
        instrument_from_here()
        for name, (calls, installs, ops) in measures.items():
            calls = max(1, calls * steps // 100)  # the timed rounds' calls, scaled to STEPS steps
            runs[name] = {"calls": calls, **{mode: [] for mode in MODES}}
            for _ in range(rounds):
                for mode, recorder in MODES.items():
                    timed.ready(recorders, recorder, installs, ops[recorder], calls)
                    runs[name][mode].append(str(run_counted(ops[recorder], calls, out)))
        timed.switch_to(recorders, None)
    finally:
        dist.destroy_process_group()
    (out / "runs.json").write_text(json.dumps(runs))


def rows(runs: dict) -> list[dict]:
    """Per measure: instructions per op of each mode (median over rounds), what the recorder
    adds, the A/A difference; and the same in estimated cycles where they were simulated."""
    result = []
    for name, run in runs.items():
        row: dict = {"measure": name, "calls": run["calls"]}
        for unit, count in (("instructions", lambda c: c["Ir"]), ("cycles", cycles)):
            rounds = {}
            for mode in MODES:
                values = [count(totals(Path(dump))) for dump in run[mode]]
                if None in values:
                    break
                rounds[mode] = [value / run["calls"] for value in values]
            else:
                per_op = {mode: statistics.median(values) for mode, values in rounds.items()}
                base = per_op["without"]
                row[unit] = {"without": base, "with": per_op["with"],
                             "added": per_op["with"] - base,
                             "added_pct": 100 * (per_op["with"] - base) / base,
                             "a_a_pct": 100 * (per_op["without, again"] - base) / base,
                             "rounds": rounds}
        result.append(row)
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'measure':>20} {'unit':>12} {'without':>12} {'with':>12} {'added':>10} "
             f"{'added %':>8} {'A/A %':>7}"]
    for row in results:
        for unit in ("instructions", "cycles"):
            if unit in row:
                c = row[unit]
                lines.append(f"{row['measure']:>20} {unit:>12} {c['without']:>12.0f} "
                             f"{c['with']:>12.0f} {c['added']:>10.0f} {c['added_pct']:>8.2f} "
                             f"{c['a_a_pct']:>7.2f}")
    return "\n".join(lines)


def outside(args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("error: valgrind is not installed\nHINT: apt-get install valgrind "
                 "(or: ./scripts/bootstrap.sh --system)")
    with tempfile.TemporaryDirectory(prefix="recorder-instructions-") as tmp:
        out = Path(tmp)
        command = [*callgrind_command(out, args.cache_sim), sys.executable, "-m",
                   "benchmarks.recorder_instructions", "--inside", str(out),
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   *[f"--only={name}" for name in args.only]]
        # a fixed hash seed: the same dicts and sets, so the same instructions, in every run
        ran = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONHASHSEED": "0"},
                             capture_output=True, text=True)
        if ran.returncode:
            sys.exit(f"error: the run under callgrind failed (exit {ran.returncode})\n"
                     f"{ran.stderr[-2000:]}\nHINT: its command: {' '.join(command)}")
        results = rows(json.loads((out / "runs.json").read_text()))
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"steps": args.steps, "rounds": args.rounds, "cache_sim": args.cache_sim,
                  "results": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        # matplotlib is the dev extra; without it: python -m benchmarks.plots JSON elsewhere
        with contextlib.suppress(ImportError):
            print(f"wrote {plots.recorder(report, args.json)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--steps", type=int, default=20,
                        help="steps per mode and round; the other measures' calls scale with it")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three modes")
    parser.add_argument("--cache-sim", action="store_true",
                        help="simulate caches and branches too: a cycle estimate beside the count")
    parser.add_argument("--only", action="append", default=[], metavar="MEASURE",
                        help="this measure alone (repeatable), e.g. --only wrapper")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args.inside, args.steps, args.rounds, args.only)
    else:
        outside(args)


if __name__ == "__main__":
    main()
