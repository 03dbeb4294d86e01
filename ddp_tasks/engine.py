"""The Docker engine as the tasks use it: the docker-py client, the streamed build, a streamed
one-off container, and the build inputs staged for both (wheelhouse, CA bundle).

Task modules (``image``, ``lock``, ``sif_build``) and the test fixtures call these; nothing
here is a task. The command lines and build arguments themselves come from
``ddp_tasks.image_commands`` (pure).
"""

from __future__ import annotations

import fcntl
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ddp_tasks import image_commands as ic
from ddp_tasks.flavors import Flavor
from launcher.core.errors import LaunchError

DOCKER_TIMEOUT = 3600  # seconds; a cold build downloads a few hundred MB of wheels


def docker_client(timeout: int = DOCKER_TIMEOUT):
    """A docker-py client for the local engine, or a LaunchError that says how to start one."""
    import docker

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except docker.errors.DockerException as error:
        raise LaunchError(
            f"cannot reach the Docker engine ({error})",
            hint="start it (as root: `dockerd >/var/log/dockerd.log 2>&1 &`, or "
                 "`systemctl start docker`) or set DOCKER_HOST",
        ) from error
    return client


def image_exists(client, tag: str) -> bool:
    import docker

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def stream_build(client, out=sys.stdout, **kwargs) -> str:
    """Run a build through the engine API, print its progress, return the image id."""
    image_id = ""
    for chunk in client.api.build(decode=True, rm=True, forcerm=True, **kwargs):
        if "error" in chunk:
            raise LaunchError(f"image build failed: {chunk['error'].strip()}",
                              hint="the build log above shows the failing step")
        if "stream" in chunk:
            out.write(chunk["stream"])
            out.flush()
        image_id = chunk.get("aux", {}).get("ID", image_id)
    return image_id


def run_streamed(client, image: str, command: list[str], *, out=sys.stdout,
                 timeout: int = 1800, **kwargs) -> int:
    """Run COMMAND in a fresh container of IMAGE, print its output, remove it; its status."""
    container = client.containers.run(image, command, detach=True, **kwargs)
    try:
        for chunk in container.logs(stream=True, follow=True):
            out.write(chunk.decode(errors="replace"))
        return container.wait(timeout=timeout)["StatusCode"]
    finally:
        container.remove(force=True)


#: builds rewrite .build-inputs/ in the checkout: one at a time on a machine (test sessions,
#: benchmarks and users run side by side)
BUILD_LOCK = Path(tempfile.gettempdir()) / "ddp-image-build.lock"


@contextmanager
def build_lock():
    with open(BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ------------------------------------------------------------------------------ build inputs

def wheelhouse_source(wheelhouse: str) -> Path | None:
    """The wheelhouse directory (relative to the checkout), or None for no wheelhouse.

    The default ``.wheelhouse`` is optional: missing, it is none. A directory the user named
    must exist: a typo would otherwise send pip to the network without a word.
    """
    if not wheelhouse:
        return None
    source = ic.ROOT / wheelhouse
    if source.is_dir():
        return source
    if wheelhouse == ic.DEFAULT_WHEELHOUSE:
        return None
    raise LaunchError(f"wheelhouse {source} is not a directory",
                      hint="create it with `pip download --no-deps torch==VERSION -d DIR` "
                           "or leave --wheelhouse out")


def stage_wheels(flavor: Flavor, source: Path | None, into: Path,
                 torch_into: Path | None = None) -> bool:
    """Hard-link (wheels are hundreds of MB; a copy across filesystems) SOURCE's wheels that
    may be offered to pip for FLAVOR (``Flavor.fits_wheel``) into INTO, torch's into
    TORCH_INTO where given; whether torch is one."""
    for wheel in sorted(source.glob("*.whl")) if source else []:
        if not flavor.fits_wheel(wheel.name):
            continue
        target = (torch_into or into) if wheel.name.startswith("torch-") else into
        try:
            (target / wheel.name).hardlink_to(wheel)
        except OSError:
            shutil.copy2(wheel, target / wheel.name)
    return any((torch_into or into).glob("torch-*.whl"))


def checked_ca_bundle(ca_bundle: str) -> Path:
    """The CA bundle's path, or a LaunchError naming a missing one."""
    bundle = Path(ca_bundle)
    if not bundle.is_file():
        raise LaunchError(f"CA bundle {bundle} does not exist",
                          hint="give the full bundle your host trusts, e.g. "
                               "/etc/ssl/certs/ca-certificates.crt")
    return bundle


def stage_build_inputs(wheelhouse: str, ca_bundle: str, *, flavor: Flavor,
                       root: Path = ic.ROOT) -> Path:
    """Fill ``.build-inputs/`` in the context ROOT: links to the wheels, a copy of the CA bundle.

    ``base/`` (``wheelhouse/`` and the bundle) is copied at the start of the build stage,
    ``torch/`` (the torch wheels) only before torch is installed: another torch wheel, as the
    tests' stand-ins, then reuses the MPI layers instead of building them again. Stateless:
    what a previous build left there is replaced, so a build without ``--ca-bundle`` never uses
    an old bundle. Torch wheels of another flavor (``torch-*+cpu`` for cuda) stay out: pip
    would prefer them, their local version sorting above PyPI's.
    """
    inputs = root / ic.BUILD_INPUTS
    shutil.rmtree(inputs, ignore_errors=True)
    base = inputs / ic.BASE_INPUTS
    (base / "wheelhouse").mkdir(parents=True)
    (inputs / ic.TORCH_INPUTS).mkdir()
    stage_wheels(flavor, wheelhouse_source(wheelhouse), base / "wheelhouse",
                 inputs / ic.TORCH_INPUTS)
    if ca_bundle:
        shutil.copy2(checked_ca_bundle(ca_bundle), base / ic.CA_BUNDLE_NAME)
    return inputs
