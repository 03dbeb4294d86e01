"""Image tasks: ``base`` (Debian base without a registry), ``build``, ``push``, ``chimage``.

Thin wrappers: the command lines and build arguments come from ``ddp_tasks.image_commands``;
the work is done by debootstrap, docker-py (the Docker engine API) and ch-convert. The SIF
tasks are in ``ddp_tasks.sif_build``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ddp_tasks import flavors
from ddp_tasks import image_commands as ic
from ddp_tasks.engine import (
    build_lock,
    docker_client,
    image_exists,
    stage_build_inputs,
    stream_build,
)
from ddp_tasks.image_params import IMAGE, ImageParams
from ddp_tasks.task_errors import shown_only, user_errors
from ddp_tasks.task_params import documented
from launcher import __version__
from launcher.core.errors import LaunchError

# ---------------------------------------------------------------------------------------- base

def make_base(tag: str = IMAGE.tag, suite: str = IMAGE.suite, mirror: str = IMAGE.mirror,
              out=sys.stdout) -> str:
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
        for relative, text in ic.BASE_IMAGE_FILES.items():
            (rootfs / relative).parent.mkdir(parents=True, exist_ok=True)
            (rootfs / relative).write_text(text)
        for pattern in ic.BASE_IMAGE_PRUNE:
            for entry in rootfs.glob(pattern):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
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


@documented(ImageParams)
def base(c, tag=IMAGE.tag, suite=IMAGE.suite, mirror=IMAGE.mirror):
    """Make a Debian base image from the Debian mirror (for sites with no registry access)."""
    with user_errors():
        make_base(tag, suite, mirror)


# --------------------------------------------------------------------------------------- build

def build_image(*, flavor: str = IMAGE.flavor, name: str = IMAGE.name,
                base_image: str = IMAGE.base_image, wheelhouse: str = IMAGE.wheelhouse,
                ca_bundle: str = IMAGE.ca_bundle, keep_ca: bool = IMAGE.keep_ca,
                build_args: str = IMAGE.build_args, nocache: bool = IMAGE.nocache,
                reuse_current: bool = False, out=sys.stdout) -> str:
    """Build docker/Dockerfile as NAME:FLAVOR; returns the tag (the work behind `invoke build`).

    ``reuse_current``: keep an existing NAME:FLAVOR built from the same sources and inputs
    (its ``io.ddp.source-digest`` label) without asking the engine.
    """
    spec = flavors.get(flavor)
    tag = ic.image_tag(name, flavor)
    client = docker_client()
    with build_lock():
        inputs = stage_build_inputs(wheelhouse, ca_bundle, flavor=spec)
        digest = ic.source_digest()
        if reuse_current and image_exists(client, tag) \
                and client.images.get(tag).labels.get("io.ddp.source-digest") == digest:
            print(f"{tag} is current (source digest {digest})", file=out, flush=True)
            return tag
        has_torch = any((inputs / ic.TORCH_INPUTS).glob("torch-*.whl"))
        args = ic.build_args(
            flavor=spec, base_image=base_image,
            identity=ic.image_identity(name, __version__, flavor),
            torch_index_url=ic.torch_index_for(spec, has_torch),
            source_digest=digest, keep_ca=keep_ca, extra=ic.parse_build_args(build_args))
        print(f"building {tag} with " + " ".join(
            f"{k}={v}" for k, v in args.items()), file=out, flush=True)
        stream_build(client, out=out, path=str(ic.ROOT), dockerfile="docker/Dockerfile",
                     tag=tag, buildargs=args, target="runtime", nocache=nocache)
    return tag


@documented(ImageParams, notes={"flavor": flavors.HELP})
def build(c, flavor=IMAGE.flavor, name=IMAGE.name, base_image=IMAGE.base_image,
          wheelhouse=IMAGE.wheelhouse, ca_bundle=IMAGE.ca_bundle, keep_ca=IMAGE.keep_ca,
          build_args=IMAGE.build_args, nocache=IMAGE.nocache):
    """Build the image for one flavor from docker/Dockerfile (progress is streamed)."""
    with user_errors():
        build_image(flavor=flavor, name=name, base_image=base_image, wheelhouse=wheelhouse,
                    ca_bundle=ca_bundle or os.environ.get("PIP_CERT", ""), keep_ca=keep_ca,
                    build_args=build_args, nocache=nocache)


# ---------------------------------------------------------------------------------------- push

def push_image(*, registry: str, flavor: str = IMAGE.flavor, name: str = IMAGE.name,
               out=sys.stdout) -> str:
    """Tag NAME:FLAVOR as REGISTRY/NAME:FLAVOR, push it, return ``REGISTRY/NAME@DIGEST``.

    Credentials come from the user's docker config (``docker login``), as docker-py reads it.
    """
    flavors.get(flavor)
    if not registry:
        raise LaunchError("no registry to push to",
                          hint="pass --registry HOST[:PORT][/PATH] or set DDP_REGISTRY")
    client = docker_client()
    local = ic.image_tag(name, flavor)
    if not image_exists(client, local):
        raise LaunchError(f"image {local} does not exist", hint="build it first: invoke build")
    repository, tag = ic.push_reference(registry, name, flavor)
    client.images.get(local).tag(repository, tag)
    digest = ""
    for chunk in client.api.push(repository, tag=tag, stream=True, decode=True):
        if "error" in chunk:
            raise LaunchError(f"push of {repository}:{tag} failed: {chunk['error']}",
                              hint="log in with `docker login " + registry.split("/")[0] +
                                   "`; a plain-HTTP registry other than localhost must be "
                                   "listed in the engine's insecure-registries")
        if chunk.get("status") and "id" not in chunk:
            print(chunk["status"], file=out, flush=True)
        digest = chunk.get("aux", {}).get("Digest", digest)
    reference = f"{repository}@{digest}"
    print(f"pushed {reference}", file=out, flush=True)
    return reference


@documented(ImageParams)
def push(c, registry=IMAGE.registry, flavor=IMAGE.flavor, name=IMAGE.name):
    """Push NAME:FLAVOR to a registry and print its digest (credentials: ~/.docker/config.json)."""
    with user_errors():
        push_image(registry=registry or os.environ.get("DDP_REGISTRY", ""), flavor=flavor,
                   name=name)


# ----------------------------------------------------------------------------------- chimage

@documented(ImageParams, notes={
    "output": "directory image to write (default NAME-FLAVOR: what `invoke run --runtime "
              "charliecloud` runs); replaced if it exists"})
def chimage(c, output="", flavor=IMAGE.flavor, name=IMAGE.name, image=IMAGE.image,
            dry_run=IMAGE.dry_run):
    """Convert the Docker image into a Charliecloud image for `ch-run` (needs ch-convert)."""
    with user_errors():
        flavors.get(flavor)
        command = ic.chimage_command(image or ic.image_tag(name, flavor),
                                     output or f"{name}-{flavor}")
        if shown_only(command, dry_run, "apt-get install charliecloud-builders "
                       "charliecloud-runtime (Debian 12), or see https://hpc.github.io/charliecloud/"):
            return
    # ch-convert refuses an existing output; a new conversion replaces the old image
    shutil.rmtree(command[-1], ignore_errors=True)
    subprocess.run(command, check=True, timeout=1800, cwd=ic.ROOT)


TASKS = [base, build, push, chimage]
