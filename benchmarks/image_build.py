"""Image build benchmark: cold build, rebuild after a code-only change, size, per flavor; with
``--sif``, the flavor's SIF too (benchmarks/sif_image.py: build time, size, start-up).

    .venv/bin/python -m benchmarks.image_build [--flavors cpu,cuda] [--skip-cold] [--json PATH]
    .venv/bin/python -m benchmarks.image_build --flavors cpu --sif [--sif-only]

Builds each flavor the way the tests do (`invoke build --flavor F --base-image
ddp-base:bookworm --ca-bundle /etc/ssl/certs/ca-certificates.crt`, CPU torch wheel in
.wheelhouse/), the flavors side by side in one run, prints a table and writes JSON.
Goals: code-only rebuild < 15 s for both, cpu image <= 1.2 GB, cuda image <= 6.5 GB; the cpu SIF
<= 0.6 x the Docker image's size, built in <= 60 s.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import RESULTS, ROOT, sif_image
from ddp_tasks import engine, flavors
from ddp_tasks import image as image_tasks
from ddp_tasks import image_commands as ic

GOALS = {"rebuild_s": 15.0, "size_gb": {"cpu": 1.2, "cuda": 6.5}}
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# a new module under launcher/: a code-only change that must not touch the dependency layers
PROBE = ROOT / "launcher" / "_rebuild_probe.py"
RESULT = RESULTS / "image_build.json"


def timed_build(**options) -> tuple[float, int]:
    """Seconds for one build, and how many of its steps ran instead of coming from the cache."""
    out = io.StringIO()
    start = time.monotonic()
    image_tasks.build_image(out=out, **options)
    return time.monotonic() - start, out.getvalue().count(" ---> Running in ")


def measure(client, flavor: str, cold: bool) -> dict:
    """Cold, no-op and code-only builds of FLAVOR, and its size."""
    options = {"flavor": flavor, "base_image": ic.DEFAULT_BASE_TAG,
               "ca_bundle": str(HOST_CA_BUNDLE) if HOST_CA_BUNDLE.is_file() else ""}
    found: dict[str, float | int | None] = {"cold_s": None, "cold_steps_run": None}
    if cold:
        found["cold_s"], found["cold_steps_run"] = timed_build(nocache=True, **options)
    # nothing changed: every layer comes from the cache
    found["noop_s"], found["noop_steps_run"] = timed_build(**options)
    PROBE.write_text(f"# rebuild probe {time.time()}\n")
    try:
        found["rebuild_s"], found["rebuild_steps_run"] = timed_build(**options)
    finally:
        PROBE.unlink()
    timed_build(**options)  # back to the image of the committed source
    found["size_gb"] = client.images.get(ic.image_tag(ic.DEFAULT_NAME, flavor)).attrs["Size"] / 1e9
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", default=",".join(flavors.NAMES),
                        help="comma-separated flavors to build (default: all)")
    parser.add_argument("--skip-cold", action="store_true",
                        help="skip the cold (no cache) build, which takes minutes")
    parser.add_argument("--json", default=str(RESULT),
                        help=f"where to write the results (default {RESULT.relative_to(ROOT)})")
    parser.add_argument("--sif", action="store_true",
                        help="also build each flavor's SIF without Apptainer and time start-up "
                             "from it, the Docker image and the venv (needs siftool, "
                             "squashfs-tools, squashfuse, ch-run)")
    parser.add_argument("--sif-only", action="store_true",
                        help="with --sif: measure the SIF of the image as it is, no image builds")
    parser.add_argument("--sif-rounds", type=int, default=5,
                        help="start-up rounds, the contenders taking turns (default 5)")
    args = parser.parse_args()

    client = engine.docker_client()
    if not engine.image_exists(client, ic.DEFAULT_BASE_TAG):
        image_tasks.make_base(ic.DEFAULT_BASE_TAG)
    results: dict[str, dict] = {}
    for flavor in args.flavors.split(","):
        results[flavor] = {} if args.sif_only else measure(client, flavor, cold=not args.skip_cold)
        if args.sif:
            results[flavor]["sif"] = sif_image.measure(
                client, ic.image_tag(ic.DEFAULT_NAME, flavor), flavor, args.sif_rounds)
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"
    # the machine is shared: a busy one explains slow figures
    load = os.getloadavg()[0]

    if not args.sif_only:
        print(f"{'flavor':6} {'measure':34} {'value':>10}  {'steps run':>9}  {'goal':>9}  ok")
    for flavor, found in results.items():
        if args.sif:
            print(f"{flavor}: " + "\n".join(sif_image.table(found["sif"])))
            sif_image.plot(found["sif"], Path(args.json).with_name(f"sif_{flavor}.png"))
        if args.sif_only:
            continue
        rows = [("cold build (no cache)", found["cold_s"], "s", None, found["cold_steps_run"]),
                ("no-op rebuild", found["noop_s"], "s", None, found["noop_steps_run"]),
                ("rebuild after a code-only change", found["rebuild_s"], "s",
                 GOALS["rebuild_s"], found["rebuild_steps_run"]),
                ("runtime image size", found["size_gb"], "GB", GOALS["size_gb"][flavor], None)]
        for name, value, unit, goal, steps in rows:
            shown = "skipped" if value is None else f"{value:.2f} {unit}"
            ok = "" if goal is None or value is None else ("yes" if value <= goal else "NO")
            goal_text = "" if goal is None else f"<= {goal} {unit}"
            print(f"{flavor:6} {name:34} {shown:>10}  {'' if steps is None else steps:>9}  "
                  f"{goal_text:>9}  {ok}")
    print(f"load average (1 min) at the end: {load:.1f} on {os.cpu_count()} cores")
    results = {"flavors": results, "machine": machine, "load_average_1min_at_end": load}
    goals = {**GOALS, "sif": sif_image.GOALS}
    Path(args.json).write_text(json.dumps({"results": results, "goals": goals}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
