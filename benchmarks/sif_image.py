"""The SIF beside the Docker image: build time and size, and the start-up of a 2-rank
``launcher.check --backend mpi`` from each. Called by ``benchmarks/image_build.py --sif``.

Start-up contenders, taking turns in each round so that load from other processes falls on all
of them alike (wall time from the launcher's start to its exit, median over the rounds):

- ``venv``: the venv's Hydra ``mpiexec`` starts the venv's Python;
- ``docker image``: ``docker run --rm IMAGE mpiexec -n 2 ...``: the image's own Hydra in one
  container (the container's creation and removal included);
- ``SIF (ch-run)``: the venv's ``mpiexec`` starts ``ch-run`` on the SIF's mounted partition, the
  line ``invoke run --runtime charliecloud --image ddp-cpu.sif`` prints; the squashfuse mount
  is timed once, on its own.
"""

from __future__ import annotations

import getpass
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_tasks import sif_build, sif_mount
from ddp_tasks.commands import Launch, container_argv

GOALS = {"sif_size_ratio": 0.6, "sif_build_s": 60.0}
CHECK = ["python", "-m", "launcher.check", "--backend", "mpi"]


def build(tag: str, flavor: str, directory: Path) -> dict:
    """Seconds and bytes of ``invoke sif --builder native``'s build of TAG."""
    output = directory / f"ddp-{flavor}.sif"
    start = time.monotonic()
    with open(os.devnull, "w") as quiet:
        size, digest = sif_build.build_native(tag=tag, flavor=flavor, output=output, out=quiet)
    return {"path": str(output), "build_s": time.monotonic() - start, "size_bytes": size,
            "partition_sha256": digest}


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    if result.returncode != 0 or "check passed" not in result.stdout:
        raise RuntimeError(f"{argv[0]} failed ({result.returncode}):\n{result.stdout}\n"
                           f"{result.stderr}")
    return took


def startup(tag: str, sif: Path, rounds: int) -> dict:
    """Median seconds of a 2-rank launcher.check per contender, and the mount's seconds."""
    venv_bin = Path(sys.executable).parent
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "USER": os.environ.get("USER") or getpass.getuser()}
    mpiexec = [str(venv_bin / "mpiexec"), "-n", "2"]
    start = time.monotonic()
    with sif_mount.mounted(sif, Path(tempfile.mkdtemp(prefix="ddp-sif-bench-"))) as root:
        mount_s = time.monotonic() - start
        ch_run = container_argv(Launch(runtime="charliecloud", image=str(root),
                                       procs_per_node=2))
        contenders = {
            "venv": [*mpiexec, *CHECK],
            "docker image": ["docker", "run", "--rm", tag, "mpiexec", "-n", "2", *CHECK],
            "SIF (ch-run)": [*mpiexec, *ch_run, *CHECK],
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, argv in contenders.items():
                times[name].append(_timed(argv, env))
    return {"mount_s": mount_s, "rounds": rounds,
            "median_s": {name: statistics.median(found) for name, found in times.items()}}


def measure(client, tag: str, flavor: str, rounds: int) -> dict:
    image_bytes = client.images.get(tag).attrs["Size"]
    with tempfile.TemporaryDirectory(prefix="ddp-sif-bench-") as tmp:
        found = build(tag, flavor, Path(tmp))
        found.update(startup(tag, Path(found.pop("path")), rounds))
    found["image_bytes"] = image_bytes
    found["size_ratio"] = found["size_bytes"] / image_bytes
    return found


def table(found: dict) -> list[str]:
    size_ok = "yes" if found["size_ratio"] <= GOALS["sif_size_ratio"] else "NO"
    build_ok = "yes" if found["build_s"] <= GOALS["sif_build_s"] else "NO"
    lines = [f"SIF build {found['build_s']:.1f} s (goal <= {GOALS['sif_build_s']:.0f} s: "
             f"{build_ok}); size {found['size_bytes'] / 1e9:.3f} GB = "
             f"{found['size_ratio']:.2f} x the Docker image's {found['image_bytes'] / 1e9:.2f} GB "
             f"(goal <= {GOALS['sif_size_ratio']}: {size_ok})",
             f"squashfuse mount of the partition: {found['mount_s']:.2f} s",
             f"2-rank launcher.check --backend mpi, median of {found['rounds']} rounds:"]
    lines += [f"  {name:14} {seconds:6.2f} s" for name, seconds in found["median_s"].items()]
    return lines


def plot(found: dict, path: Path) -> Path:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3))
    names = list(found["median_s"])
    axis.barh(names, [found["median_s"][name] for name in names], color="#4477aa")
    axis.set_xlabel("seconds, 2-rank launcher.check --backend mpi (median)")
    axis.set_title(f"start-up; SIF {found['size_bytes'] / 1e9:.2f} GB vs image "
                   f"{found['image_bytes'] / 1e9:.2f} GB")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
