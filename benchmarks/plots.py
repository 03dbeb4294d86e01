"""PNG plots of the benchmarks' JSON, drawn on the host (matplotlib: the dev extra).

    .venv/bin/python -m benchmarks.plots benchmarks/results/allreduce.json [...]

Each JSON gets a PNG of the same name beside it: an all_reduce result (benchmarks/allreduce.py,
also run across nodes by benchmarks/cluster.py) as bus bandwidth against message size with the
link's floor; a weak-scaling result (benchmarks/train_scaling.py, cluster.py) as bars; a
binding result (benchmarks/binding.py) as bars per rank count; the recorder's share of a step
(benchmarks/recorder_instructions.py) as bars against issue 36's 2 %; huge pages' speedup
(benchmarks/huge_pages.py) as lines against the size; what each layer of the compiled backend
adds to raw MPI (benchmarks/allreduce_layers.py) as lines against the size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.units import bus_factor, human

SERIES = {"mpi4py": "mpi backend (mpi4py)", "gloo": "gloo", "raw": "raw mpi4py Allreduce"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(plt, figure, path: Path) -> Path:
    """The figure as the PNG beside ``path``, its memory let go."""
    figure.tight_layout()
    out = path.with_suffix(".png")
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def allreduce(result: dict, path: Path) -> Path:
    """Bus bandwidth of each contender against the size, and the link (the floor) as a line."""
    plt = _pyplot()
    rows = result["allreduce"]
    sizes = [row["bytes"] for row in rows]
    figure, axes = plt.subplots(figsize=(8.5, 4))
    for name, label in SERIES.items():
        axes.plot(sizes, [row[f"{name}_median_busGBps"] for row in rows], marker="o",
                  label=label)
    imb = result.get("imb")  # benchmarks/cluster.py --imb: Intel MPI's IMB-MPI1
    if imb:
        factor = bus_factor(result["world_size"])
        axes.plot([r["bytes"] for r in imb], [r["bytes"] / r["imb_us"] / 1e3 * factor
                                               for r in imb],
                  marker="x", linestyle="-.", label="IMB-MPI1 Allreduce (Intel MPI)")
    link = result["floor"]["link_GBps"]
    axes.axhline(link, color="black", linestyle="--",
                 label=f"link, one way ({link:.2f} GB/s): the floor")
    exchange = result["floor"].get("exchange_GBps")
    if exchange is not None:  # results written before it was measured have none
        axes.axhline(exchange, color="grey", linestyle=":",
                     label=f"each rank while all exchange at once ({exchange:.2f} GB/s)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [human(s) for s in sizes], rotation=30)
    axes.set_xlabel("all_reduce message (float32)")
    axes.set_ylabel("bus bandwidth of the median call (GB/s)")
    nodes = result.get("nodes", 1)
    evicted = result.get("evict_mib")  # absent from the runs before it was an option
    cold = f", {evicted} MiB written before each call" if evicted else ""
    axes.set_title(f"all_reduce, {result['world_size']} ranks on {nodes} "
                   f"node{'s' if nodes > 1 else ''}{cold}")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    axes.grid(alpha=0.3)
    return _saved(plt, figure, path)


def scaling(rows: list[dict], title: str, path: Path) -> Path:
    """Weak-scaling efficiency per backend as bars, with the goal as a line.

    ROWS: ``{"label": ..., "efficiency": ..., "goal": ...}``, one bar each."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(5.5, 3.5))
    bars = axes.bar([row["label"] for row in rows], [row["efficiency"] for row in rows],
                    color=["tab:blue" if "mpi" in row["label"] else "tab:orange" for row in rows])
    axes.bar_label(bars, fmt="%.2f")
    goals = {row["goal"] for row in rows if row.get("goal")}
    for goal in goals:
        axes.axhline(goal, color="black", linestyle="--", label=f"goal {goal}")
    axes.set_ylim(0, 1.1)
    axes.set_ylabel("weak-scaling efficiency")
    axes.set_title(title)
    if goals:
        axes.legend(fontsize="small")
    return _saved(plt, figure, path)


def binding(result: dict, path: Path) -> Path:
    """Samples/s of each --bind variant (benchmarks/binding.py) as bars, grouped by rank
    count, each labelled with its ratio to ``none``."""
    plt = _pyplot()
    counts = sorted({row["ranks"] for row in result["rows"]})
    modes = list(dict.fromkeys(row["mode"] for row in result["rows"]))
    by = {(row["ranks"], row["mode"]): row for row in result["rows"] if row.get("median")}
    figure, axes = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = [by.get((count, mode)) for count in counts]
        bars = axes.bar([c + (i - (len(modes) - 1) / 2) * width for c in range(len(counts))],
                        [row["median"] if row else 0 for row in rows], width,
                        label=f"--bind {mode}")
        axes.bar_label(bars, fontsize="small", labels=[
            f"{row['median'] / by[(row['ranks'], modes[0])]['median']:.2f}x" if row else ""
            for row in rows])
    axes.set_xticks(range(len(counts)), [f"{count} ranks" for count in counts])
    axes.set_ylabel("samples/s (median of rounds)")
    axes.set_title(f"CPU training with and without binding, CPUs {result['host']['cpus']}",
                   fontsize="medium")
    axes.legend(fontsize="small", loc="lower right")
    return _saved(plt, figure, path)


def recorder(result: dict, path: Path) -> Path:
    """What the flight recorder adds to each step measure, in instructions and (where
    simulated) cycles, beside the A/A difference of two runs without it and the 2 % goal."""
    plt = _pyplot()
    # the steps, where the goal is a share; every measure where only others were run
    rows = [row for row in result["results"] if row["measure"].startswith("step")] or \
        result["results"]
    units = [unit for unit in ("instructions", "cycles") if unit in rows[0]]
    figure, axes = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / (2 * len(units))
    for i, (unit, key) in enumerate((u, k) for u in units for k in ("added_pct", "a_a_pct")):
        bars = axes.barh([r + (i - (2 * len(units) - 1) / 2) * width for r in range(len(rows))],
                         [row[unit][key] for row in rows], width,
                         label=f"{unit}: {'with the recorder' if key == 'added_pct' else 'A/A'}")
        axes.bar_label(bars, fmt="%.2f %%", fontsize="small")
    axes.axvline(2.0, color="tab:red", linestyle="--", label="goal: 2 %")
    axes.set_yticks(range(len(rows)), [row["measure"] for row in rows])
    axes.set_xlabel("% of the step without the recorder (callgrind)")
    axes.legend(fontsize="small", loc="lower right")
    return _saved(plt, figure, path)


def huge_pages(result: dict, path: Path) -> Path:
    """Each contender's speedup on huge pages over 4 KiB pages against the size: on huge pages
    throughout (solid) and on torch's own buffer (dashed)."""
    plt = _pyplot()
    rows = result["allreduce"]
    sizes = [row["bytes"] for row in rows]
    names = [k.removesuffix("_small_median_us") for k in rows[0] if k.endswith("_small_median_us")]
    figure, axes = plt.subplots(figsize=(7.5, 3.8))
    for i, name in enumerate(names):
        for pages, style in (("huge", "-"), ("torch", "--")):
            axes.plot(sizes, [row[f"{name}_{pages}_speedup_median"] for row in rows],
                      marker="o", linestyle=style, color=f"C{i}",
                      label=f"{name}, {'huge pages' if pages == 'huge' else 'torch buffer'}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [human(s) for s in sizes], rotation=30)
    axes.set_xlabel("all_reduce message (float32)")
    axes.set_ylabel("speedup over 4 KiB pages (median)")
    tunables = result.get("glibc_tunables")  # absent from the runs before it was recorded
    glibc = f", GLIBC_TUNABLES={tunables}" if tunables else ""
    axes.set_title(f"all_reduce on huge pages, {result['world_size']} ranks, one node "
                   f"(kernel: {result['transparent_hugepage']}{glibc})", fontsize="medium")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))
    axes.grid(alpha=0.3)
    return _saved(plt, figure, path)


def layers(result: dict, path: Path) -> Path:
    """Each layer's median time minus raw MPI's against the size, and torch's front end's own
    time, warm and after an MPI call, dashed (benchmarks/allreduce_layers)."""
    plt = _pyplot()
    rows = result["layers"]
    sizes = [row["bytes"] for row in rows]
    names = [k.removesuffix("_minus_raw_median_us") for k in rows[0]
             if k.endswith("_minus_raw_median_us") and not k.startswith("raw_minus")]
    figure, axes = plt.subplots(figsize=(7.5, 3.8))
    for name in names:
        axes.plot(sizes, [row[f"{name}_minus_raw_median_us"] for row in rows], marker="o",
                  label=name)
    for name in ("front_end", "front_end_in_turn"):
        if f"{name}_median_us" in rows[0]:  # runs before 2026-12-06 have no yardstick
            axes.plot(sizes, [row[f"{name}_median_us"] for row in rows], marker="x",
                      linestyle="--", label=f"{name} (its own time)")
    axes.axhline(0.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [human(s) for s in sizes], rotation=30)
    axes.set_xlabel("all_reduce message (float32)")
    axes.set_ylabel("time minus raw MPI's, us (median)")
    axes.set_title(f"the compiled backend's layers, {result['world_size']} ranks",
                   fontsize="medium")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))
    axes.grid(alpha=0.3)
    return _saved(plt, figure, path)


def if_possible(path: Path) -> None:
    """The PNG beside the JSON where matplotlib is installed (the dev venv; not the image, where
    benchmarks/cluster.py draws it on the host instead)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    main([str(path)])


def main(paths: list[str]) -> int:
    for name in paths:
        path = Path(name)
        result = json.loads(path.read_text())
        if "layers" in result:
            print(f"wrote {layers(result, path)}")
        elif "transparent_hugepage" in result:
            print(f"wrote {huge_pages(result, path)}")
        elif "allreduce" in result and isinstance(result["allreduce"], list):
            print(f"wrote {allreduce(result, path)}")
        elif "rows" in result and "host" in result:
            print(f"wrote {binding(result, path)}")
        elif "cache_sim" in result:
            print(f"wrote {recorder(result, path)}")
        else:
            print(f"{path}: not an all_reduce result; scaling plots are written by their "
                  "benchmark", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
