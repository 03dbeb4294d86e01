"""Image build benchmark: cold build, rebuild after a code-only change, runtime image size.

    .venv/bin/python benchmarks/image_build.py [--skip-cold] [--json PATH]

Builds the cpu image the way the tests do (`invoke build --base-image ddp-base:bookworm
--ca-bundle /etc/ssl/certs/ca-certificates.crt`, CPU torch wheel in .wheelhouse/), prints a
table and writes JSON. Goals: rebuild < 15 s, cpu runtime image <= 1.2 GB.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_tasks import image as image_tasks  # noqa: E402
from ddp_tasks import image_commands as ic  # noqa: E402

GOALS = {"rebuild_s": 15.0, "size_gb": 1.2}
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# a new module under launcher/: a code-only change that must not touch the dependency layers
PROBE = ic.ROOT / "launcher" / "_rebuild_probe.py"
RESULTS = ic.ROOT / "benchmarks" / "results" / "image_build.json"


def timed_build(**options) -> tuple[float, int]:
    """Seconds for one build, and how many of its steps ran instead of coming from the cache."""
    out = io.StringIO()
    start = time.monotonic()
    image_tasks.build_image(out=out, **options)
    return time.monotonic() - start, out.getvalue().count(" ---> Running in ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cold", action="store_true",
                        help="skip the cold (no cache) build, which takes minutes")
    parser.add_argument("--json", default=str(RESULTS),
                        help=f"where to write the results (default {RESULTS.relative_to(ic.ROOT)})")
    args = parser.parse_args()

    client = image_tasks.docker_client()
    if not image_tasks.image_exists(client, ic.DEFAULT_BASE_TAG):
        image_tasks.make_base(ic.DEFAULT_BASE_TAG)
    options = {"flavor": "cpu", "base_image": ic.DEFAULT_BASE_TAG,
               "ca_bundle": str(HOST_CA_BUNDLE) if HOST_CA_BUNDLE.is_file() else ""}
    results: dict[str, float | int | str | None] = {"cold_s": None, "cold_steps_run": None}
    if not args.skip_cold:
        results["cold_s"], results["cold_steps_run"] = timed_build(nocache=True, **options)
    # nothing changed: every layer comes from the cache
    results["noop_s"], results["noop_steps_run"] = timed_build(**options)
    PROBE.write_text(f"# rebuild probe {time.time()}\n")
    try:
        results["rebuild_s"], results["rebuild_steps_run"] = timed_build(**options)
    finally:
        PROBE.unlink()
    timed_build(**options)  # back to the image of the committed source
    size = client.images.get(ic.image_tag(ic.DEFAULT_NAME, "cpu")).attrs["Size"]
    results["size_gb"] = size / 1e9
    results["machine"] = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"
    # the machine is shared: a busy one explains slow figures
    results["load_average_1min_at_end"] = os.getloadavg()[0]

    rows = [("cold build (no cache)", results["cold_s"], "s", None, results["cold_steps_run"]),
            ("no-op rebuild", results["noop_s"], "s", None, results["noop_steps_run"]),
            ("rebuild after a code-only change", results["rebuild_s"], "s", GOALS["rebuild_s"],
             results["rebuild_steps_run"]),
            ("cpu runtime image size", results["size_gb"], "GB", GOALS["size_gb"], None)]
    print(f"{'measure':34} {'value':>10}  {'steps run':>9}  {'goal':>9}  ok")
    for name, value, unit, goal, steps in rows:
        shown = "skipped" if value is None else f"{value:.2f} {unit}"
        ok = "" if goal is None or value is None else ("yes" if value <= goal else "NO")
        goal_text = "" if goal is None else f"<= {goal} {unit}"
        print(f"{name:34} {shown:>10}  {'' if steps is None else steps:>9}  {goal_text:>9}  {ok}")
    print(f"load average (1 min) at the end: {results['load_average_1min_at_end']:.1f} "
          f"on {os.cpu_count()} cores")
    Path(args.json).write_text(json.dumps({"results": results, "goals": GOALS}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
