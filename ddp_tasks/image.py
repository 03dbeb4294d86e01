"""Image tasks: ``base`` (Debian base without a registry), ``build``, ``push`` and ``sif``.

Thin wrappers: the command lines and build arguments come from ``ddp_tasks.image_commands``;
the work is done by debootstrap, docker-py (the Docker engine API) and apptainer.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from invoke import task

from ddp_tasks import image_commands as ic
from launcher.errors import LaunchError

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


# ---------------------------------------------------------------------------------------- base

def make_base(tag: str = ic.DEFAULT_BASE_TAG, suite: str = "bookworm",
              mirror: str = ic.DEBIAN_MIRROR, out=sys.stdout) -> str:
    """debootstrap a minbase Debian root filesystem and ``docker import`` it as TAG."""
    if shutil.which("debootstrap") is None:
        raise LaunchError("debootstrap is not installed",
                          hint="apt-get install -y debootstrap (it needs root)")
    client = docker_client()
    repository, _, version = tag.partition(":")
    with tempfile.TemporaryDirectory(prefix="ddp-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        command = ic.debootstrap_command(str(rootfs), suite, mirror)
        print(f"$ {shlex.join(command)}", file=out, flush=True)
        subprocess.run(command, check=True, timeout=1800, stdout=subprocess.DEVNULL)
        (rootfs / "etc/apt/sources.list").write_text(ic.apt_sources(suite, mirror))
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        print(f"importing {rootfs} as {tag}", file=out, flush=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
                               stdout=subprocess.PIPE)
        try:
            result = client.api.import_image(src=tar.stdout, repository=repository,
                                             tag=version or "latest",
                                             changes=list(ic.IMPORT_CHANGES), stream_src=True)
        finally:
            tar.stdout.close()
            tar.wait(timeout=600)
    if tar.returncode != 0:
        raise LaunchError(f"tar of the root filesystem failed ({tar.returncode})")
    image_id = json.loads(result.strip().splitlines()[-1]).get("status", "")
    print(f"{tag} {image_id}", file=out, flush=True)
    return tag


@task(help={
    "tag": f"name:tag of the imported image (default {ic.DEFAULT_BASE_TAG})",
    "suite": "Debian release to bootstrap (default bookworm: its python3 is 3.11)",
    "mirror": f"Debian mirror or a local proxy of it (default {ic.DEBIAN_MIRROR})",
})
def base(c, tag=ic.DEFAULT_BASE_TAG, suite="bookworm", mirror=ic.DEBIAN_MIRROR):
    """Make a Debian base image from the Debian mirror (for sites with no registry access)."""
    make_base(tag, suite, mirror)


TASKS = [base]
