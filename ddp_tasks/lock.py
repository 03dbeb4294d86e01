"""``invoke lock``: resolve every Python package of a flavor's image and write its lock file.

pip resolves inside the Dockerfile's ``python`` stage (the base image's CPython, the venv's pip,
the image's platform), with ``--dry-run --report``: nothing is installed, and wheels with
published metadata are not even downloaded. The text comes from ``ddp_tasks.lock_file``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ddp_tasks import flavors, lock_file
from ddp_tasks import image_commands as ic
from ddp_tasks.engine import (
    checked_ca_bundle,
    docker_client,
    run_streamed,
    stage_wheels,
    stream_build,
    wheelhouse_source,
)
from ddp_tasks.image_params import IMAGE, ImageParams
from ddp_tasks.task_errors import user_errors
from ddp_tasks.task_params import documented
from launcher.core.errors import LaunchError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (the tasks extra)
    import tomli as tomllib


def make_lock(*, flavor: str = IMAGE.flavor, base_image: str = IMAGE.base_image,
              wheelhouse: str = IMAGE.wheelhouse, ca_bundle: str = IMAGE.ca_bundle,
              output: Path | None = None, out=sys.stdout) -> Path:
    """Resolve FLAVOR's packages in the python stage and write OUTPUT (default
    ``docker/lock-FLAVOR.txt``)."""
    spec = flavors.get(flavor)
    pins = ic.pins()
    dependencies = tomllib.loads((ic.ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    wanted = lock_file.requests(spec, pins, dependencies)
    source = wheelhouse_source(wheelhouse)
    bundle = checked_ca_bundle(ca_bundle).resolve() if ca_bundle else None
    client = docker_client()
    with tempfile.TemporaryDirectory(prefix="ddp-lock-") as tmp:
        work = Path(tmp)
        image = python_stage(client, base_image, work / "context", out)
        (work / "out").mkdir()
        (work / "wheelhouse").mkdir()
        environment = {"HOME": "/tmp", "PIP_NO_CACHE_DIR": "1",
                       "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_FIND_LINKS": "/wheelhouse"}
        index = ic.torch_index_for(spec, stage_wheels(spec, source, work / "wheelhouse"))
        if index:
            environment["PIP_EXTRA_INDEX_URL"] = index
        volumes = {str(work / "out"): {"bind": "/out", "mode": "rw"},
                   str(work / "wheelhouse"): {"bind": "/wheelhouse", "mode": "ro"}}
        if bundle:
            volumes[str(bundle)] = {"bind": "/tmp/ca.crt", "mode": "ro"}
            environment["PIP_CERT"] = "/tmp/ca.crt"
        script = lock_file.resolver_script(wanted, f"mpi4py=={pins['MPI4PY_VERSION']}")
        print(f"resolving in {image.removeprefix('sha256:')[:12]}:\n{script}", file=out, flush=True)
        status = run_streamed(client, image, ["bash", "-c", script], out=out,
                              environment=environment, volumes=volumes,
                              user=f"{os.getuid()}:{os.getgid()}")
        if status != 0:
            raise LaunchError(f"pip could not resolve the {flavor} flavor (exit {status})",
                              hint="pip's reason is above; behind a TLS-intercepting proxy "
                                   "pass --ca-bundle, on a closed network put the wheels in "
                                   "--wheelhouse")
        text = locked_text(flavor, wanted, work / "out")
    return write_lock(spec, text, pins, output, out)


def python_stage(client, base_image: str, context: Path, out) -> str:
    """Build the Dockerfile's python stage; its image id."""
    print(f"building the python stage of docker/Dockerfile on {base_image or 'its default base'}",
          file=out, flush=True)
    # the python stage copies nothing in: a context of the Dockerfile alone, rather than
    # the checkout with its build inputs (hundreds of MB of wheels)
    context.mkdir()
    shutil.copy(ic.ROOT / "docker" / "Dockerfile", context / "Dockerfile")
    return stream_build(client, out=out, path=str(context), dockerfile="Dockerfile",
                        target="python",
                        buildargs={"BASE_IMAGE": base_image} if base_image else {})


def locked_text(flavor: str, wanted: dict[str, list[str]], reports_dir: Path) -> str:
    """The lock file from the resolver's reports and the mpi4py sdist in REPORTS_DIR."""
    reports = {name: json.loads((reports_dir / f"{name}.json").read_text()) for name in wanted}
    sdist = next((reports_dir / "sdist").iterdir())
    return lock_file.lock_text(
        flavor, reports, {"mpi4py": hashlib.sha256(sdist.read_bytes()).hexdigest()})


def write_lock(flavor: flavors.Flavor, text: str, pins: dict[str, str], output: Path | None,
               out) -> Path:
    """Write TEXT to OUTPUT (default ``docker/lock-FLAVOR.txt``) unless it contradicts PINS,
    and its MPI sections to ``lock-mpi.txt`` beside it."""
    problems = lock_file.disagreements(flavor, text, pins)
    if problems:
        raise LaunchError(f"the resolved {flavor.name} packages contradict the pins: "
                          + "; ".join(problems),
                          hint="torch requires these versions: update the flavor's build_args "
                               "in ddp_tasks/flavors.py or the ARGs in docker/Dockerfile")
    path = output or lock_file.lock_path(flavor.name)
    path.write_text(text)
    count = sum(len(s) for s in lock_file.parse(text).values())
    print(f"wrote {path}: {count} packages", file=out, flush=True)
    shared = path.with_name(lock_file.SHARED_LOCK_NAME)
    shared.write_text(lock_file.shared_text(text))
    print(f"wrote {shared}: its MPI sections, which every flavor shares", file=out, flush=True)
    return path


@documented(ImageParams, notes={
    "flavor": "the image whose packages to lock",
    "base_image": "base image of the python stage, as for `invoke build` (default "
                  "debian:bookworm-slim)",
    "ca_bundle": "full CA bundle pip trusts, for TLS-intercepting proxies (default: $PIP_CERT)",
})
def lock(c, flavor=IMAGE.flavor, base_image=IMAGE.base_image, wheelhouse=IMAGE.wheelhouse,
         ca_bundle=IMAGE.ca_bundle):
    """Write docker/lock-FLAVOR.txt: every package of the image, pinned with its hash (and
    docker/lock-mpi.txt: its MPI sections, which every flavor shares)."""
    with user_errors():
        make_lock(flavor=flavor, base_image=base_image, wheelhouse=wheelhouse,
                  ca_bundle=ca_bundle or os.environ.get("PIP_CERT", ""))


TASKS = [lock]
