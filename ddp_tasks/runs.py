"""Looking at finished runs: ``invoke sweep-summary`` tabulates a sweep's final metrics,
``invoke plot`` draws the curves of runs or of a sweep to one PNG.

Both read ``metrics.jsonl`` through ``ddp_tasks.run_metrics``: a requeued run's repeated steps
count once. matplotlib is imported only by ``plot``; it is not in the tasks extra (tens of MB
with its fonts and numpy, for one picture), so a host without it gets an ``error:`` saying how
to install it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from invoke import task

from ddp_tasks.run_metrics import Run, read_runs
from ddp_tasks.task_errors import user_errors
from launcher.core.errors import LaunchError

#: what launcher.train writes that a summary shows as it is
_IGNORED = {"time", "event", "step", "epoch"}
#: the curves: (title, event, key) per panel; a panel no run has is left out
PANELS = (("training loss", "step", "loss"), ("test loss", "eval", "test_loss"),
          ("test accuracy", "eval", "test_accuracy"), ("samples/s", "step", "samples_per_s"))


def summary_table(runs: list[Run]) -> str:
    """One line per run: its sweep values, last step, last training loss, last evaluation,
    and how many attempts its batch script logged (requeues after preemption or lost nodes)."""
    axes = list(dict.fromkeys(name for run in runs for name, _ in run.config))
    evals = list(dict.fromkeys(key for run in runs for key in run.last("eval")
                               if key not in _IGNORED))
    header = [*(axes or ["run"]), "step", "epoch", "loss", *evals, "attempts"]
    rows = [header]
    for run in runs:
        values = dict(run.config)
        step, final = run.last("step"), run.last("eval")
        rows.append([*([values.get(a, "-") for a in axes] or [run.label]),
                     str(max(step.get("step", 0), final.get("step", 0))),
                     str(final.get("epoch", step.get("epoch", "-"))),
                     _number(step.get("loss")), *(_number(final.get(k)) for k in evals),
                     str(_attempts(run.path))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _attempts(path: Path) -> int | str:
    try:
        return len((path / "attempts.log").read_text().splitlines())
    except OSError:
        return "-"


def draw(runs: list[Run], output: Path) -> list[str]:
    """The curves of ``runs``, one line per run in each panel, written to ``output``; returns
    the panels drawn."""
    try:
        import matplotlib
    except ImportError:
        raise LaunchError("invoke plot needs matplotlib",
                          hint="pip install matplotlib (or the project's dev extra)") from None
    matplotlib.use("Agg")  # no display on a login node
    from matplotlib import pyplot

    panels = [p for p in PANELS if any(r.last(p[1]).get(p[2]) is not None for r in runs)]
    if not panels:
        raise LaunchError("the runs have no step or eval metrics yet",
                          hint="plot runs that logged at least one step (--log-every)")
    figure, axes = pyplot.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (title, event, key) in zip(axes[0], panels, strict=True):
        for run in runs:
            points = [(r["step"], r[key]) for r in run.events.get(event, []) if key in r]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, label=run.label, marker="o" if event == "eval" else None,
                        markersize=3)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=80)
    pyplot.close(figure)
    return [title for title, _, _ in panels]


def _paths(run_dirs: str) -> list[Path]:
    paths = [Path(p) for p in shlex.split(run_dirs)]
    if not paths:
        raise LaunchError("no run directory given", hint="invoke plot runs/train")
    return paths


@task(help={"run_root": "the sweep's run directory root (launcher.train's --run-dir)"})
def sweep_summary(c, run_root):
    """Print one table of final metrics per configuration of a sweep (or per run)."""
    with user_errors():
        print(summary_table(read_runs([Path(run_root)])))


@task(help={"run_dirs": "run directories or sweep roots, several in one quoted argument: "
                        "'runs/a runs/b'",
            "output": "the PNG to write (default curves.png)"})
def plot(c, run_dirs, output="curves.png"):
    """Draw loss, accuracy and throughput over steps of runs or a sweep to one PNG."""
    with user_errors():
        runs = read_runs(_paths(run_dirs))
        panels = draw(runs, Path(output))
    print(f"{output}: {', '.join(panels)} of {len(runs)} run{'s' * (len(runs) != 1)}")


TASKS = [sweep_summary, plot]
