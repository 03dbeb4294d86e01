"""``invoke sif``: the Docker image as a SIF, with ``apptainer build`` where Apptainer is
installed, else natively (``docker export``, ``mksquashfs``, ``siftool``). Command lines and
metadata come from the pure builders in ``ddp_tasks.sif_content``; this module only runs them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from invoke import task

from ddp_tasks import apptainer_def, flavors, sif_content, sif_mount
from ddp_tasks import image_commands as ic
from ddp_tasks.engine import docker_client
from ddp_tasks.image_params import IMAGE, ImageParams
from ddp_tasks.task_errors import shown_only, user_errors
from ddp_tasks.task_params import documented
from launcher.core.errors import LaunchError

BUILDERS = ("auto", "native", "apptainer")
NATIVE_TOOLS = {"mksquashfs": "squashfs-tools", "siftool": "siftool"}
APPTAINER_HINT = ("install Apptainer (https://apptainer.org/docs/admin/main/installation.html), "
                  "use --builder native, or --dry-run to see the command")


def choose_builder(builder: str) -> str:
    if builder not in BUILDERS:
        raise LaunchError(f"unknown SIF builder {builder!r}",
                          hint=f"use one of: {', '.join(BUILDERS)}")
    if builder == "auto":
        return "apptainer" if apptainer_executable() else "native"
    return builder


def apptainer_executable() -> str:
    return shutil.which("apptainer") or shutil.which("singularity") or ""


# --------------------------------------------------------------------------- the native build

def image_facts(client, tag: str) -> sif_content.Image:
    import docker

    try:
        attrs = client.images.get(tag).attrs
    except docker.errors.ImageNotFound as error:
        raise LaunchError(f"no image {tag} in the Docker engine",
                          hint="build it first: invoke build (or give --image)") from error
    return sif_content.Image(tag=tag, id=attrs["Id"], created=attrs["Created"],
                     architecture=attrs.get("Architecture", "amd64"), config=attrs["Config"])


def export_root(client, tag: str, root: Path) -> None:
    """The image's file system (``docker export`` of a container never started) into ROOT."""
    container = client.containers.create(tag, command=["true"])
    try:
        tar = subprocess.Popen(["tar", "-x", "-C", str(root), "--numeric-owner",
                                "--exclude=./.dockerenv", "--exclude=.dockerenv"],
                               stdin=subprocess.PIPE)
        try:
            for chunk in container.export():
                tar.stdin.write(chunk)
        finally:
            tar.stdin.close()
            tar.wait(timeout=600)
    finally:
        container.remove(force=True)
    if tar.returncode != 0:
        raise LaunchError(f"extracting the image's file system failed (tar {tar.returncode})")


def add_metadata(root: Path, image: sif_content.Image, definition: str) -> None:
    """Apptainer's ``/.singularity.d/``, its root symlinks and mount points, and Charliecloud's
    ``/ch/environment``, into ROOT."""
    for directory in sif_content.ROOT_DIRS:
        (root / directory).mkdir(parents=True, exist_ok=True)
    for relative in sif_content.EMPTY_FILES:
        (root / relative).unlink(missing_ok=True)
        (root / relative).write_text("")
    files = {**sif_content.metadata_files(image, definition),
             **sif_content.charliecloud_files(image)}
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
        (root / relative).chmod(sif_content.file_mode(relative))
    for name, target in sif_content.ROOT_LINKS.items():
        if not (root / name).exists() and not (root / name).is_symlink():
            (root / name).symlink_to(target)


def build_native(*, tag: str, flavor: str, output: Path, out=sys.stdout) -> tuple[int, str]:
    """Write the SIF of image TAG to OUTPUT; return its size and the partition's sha256."""
    sif_mount.require(NATIVE_TOOLS, "building a SIF without Apptainer")
    client = docker_client()
    image = image_facts(client, tag)
    definition = ic.sif_definition(ic.apptainer_def(flavor).read_text(), "docker-daemon", tag)
    output.parent.mkdir(parents=True, exist_ok=True)
    # next to OUTPUT: the partition is as big as the SIF, and the rename below stays atomic
    with tempfile.TemporaryDirectory(prefix=".ddp-sif-", dir=output.parent) as tmp:
        work = Path(tmp)
        root = work / "rootfs"
        root.mkdir()
        print(f"exporting {tag} ({image.id[:19]})", file=out, flush=True)
        export_root(client, tag, root)
        add_metadata(root, image, definition)
        partition = work / "rootfs.sqfs"
        squash = sif_content.mksquashfs_command(str(root), str(partition),
                                                sif_content.epoch(image.created),
                                                as_root=os.geteuid() == 0)
        _run(squash, out)
        (work / "Singularity").write_text(definition)
        jsons = {}
        for name, text in sif_content.json_objects(image, definition).items():
            (work / name).write_text(text)
            jsons[name] = str(work / name)
        unfinished = work / output.name
        for command in sif_content.siftool_commands(str(unfinished), str(work / "Singularity"),
                                                    jsons, str(partition), image.architecture):
            _run(command, out, quiet=True)
        digest = sif_mount.sha256_of(partition)
        unfinished.replace(output)
    return output.stat().st_size, digest


def _run(command: list[str], out, quiet: bool = False) -> None:
    print(f"$ {shlex.join(command)}", file=out, flush=True)
    subprocess.run(command, check=True, timeout=3600,
                   stdout=subprocess.DEVNULL if quiet else None)


# ------------------------------------------------------------------------------------- tasks

def sif_plan(*, output: str, flavor: str, source: str, image: str,
             executable: str = "apptainer", fakeroot: bool = False
             ) -> tuple[Path, str, list[str]]:
    """``(def path, def text, command)`` for ``apptainer build``: the flavor's def as is for
    its own source and image, else a copy pointed at IMAGE under build/."""
    flavors.get(flavor)
    own = ic.apptainer_def(flavor)
    text = own.read_text()
    wanted = ic.sif_definition(text, source, image)
    path = own if wanted == text else ic.ROOT / "build" / f"ddp-{flavor}-{source}.def"
    return path, wanted, ic.sif_command(output, str(path), executable, fakeroot)


def _apptainer_build(*, output, flavor, source, image, fakeroot, dry_run) -> None:
    executable = apptainer_executable() or "apptainer"
    path, text, command = sif_plan(output=output, flavor=flavor, source=source, image=image,
                                   executable=Path(executable).name, fakeroot=fakeroot)
    if dry_run:
        print(f"# {path.relative_to(ic.ROOT)}\n{text}", flush=True)
    if shown_only(command, dry_run, APPTAINER_HINT):
        return
    if path != ic.apptainer_def(flavor):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    subprocess.run(command, check=True, timeout=7200, cwd=ic.ROOT)


def _native_dry_run(*, output: str, flavor: str, image: str) -> None:
    """The native build's steps, with the image's values as placeholders (nothing is read)."""
    work = f"{output}.build"
    print(f"# docker export $(docker create {image}) | tar -x -C {work}/rootfs\n"
          f"# + /.singularity.d/ and /ch/environment from "
          f"{ic.apptainer_def(flavor).relative_to(ic.ROOT)} and {image}'s ENV and labels "
          "(ddp_tasks/sif_content.py)")
    commands = [sif_content.mksquashfs_command(f"{work}/rootfs", f"{work}/rootfs.sqfs",
                                       "IMAGE_CREATED_EPOCH", True)]
    commands += sif_content.siftool_commands(output, f"{work}/Singularity",
                                     {name: f"{work}/{name}" for name in
                                      (sif_content.INSPECT_METADATA, sif_content.OCI_CONFIG)},
                                     f"{work}/rootfs.sqfs", "amd64")
    for command in commands:
        print(shlex.join(command))


@documented(ImageParams, notes={
    "output": "SIF file to write (default NAME-FLAVOR.sif: ddp-cpu.sif, what `invoke run "
              "--runtime apptainer` runs)",
    "builder": "apptainer (`apptainer build` with apptainer/ddp-FLAVOR.def), native (docker "
               "export, mksquashfs, siftool: no Apptainer needed) or auto (default: apptainer "
               "where it is installed, else native)",
    "source": "for the apptainer builder, where it reads the image: docker-daemon (local "
              "engine, default), docker-archive (a `docker save` tarball: give --image FILE.tar) "
              "or docker (a registry: give --image REGISTRY/NAME:TAG)",
    "image": "image reference (default NAME:FLAVOR); the native builder reads the local engine",
    "fakeroot": "apptainer builder: build with --fakeroot (unprivileged users)",
    "dry_run": "print the definition file and the commands, run nothing",
})
def sif(c, output="", flavor=IMAGE.flavor, name=IMAGE.name, builder="auto",
        source="docker-daemon", image=IMAGE.image, fakeroot=False, dry_run=IMAGE.dry_run):
    """Build a SIF from the Docker image; print its size and its system partition's sha256."""
    with user_errors():
        flavors.get(flavor)
        output = output or f"{name}-{flavor}.sif"
        image = image or ic.image_tag(name, flavor)
        if choose_builder(builder) == "apptainer":
            _apptainer_build(output=output, flavor=flavor, source=source, image=image,
                             fakeroot=fakeroot, dry_run=dry_run)
            return
        if source != "docker-daemon":
            raise LaunchError(f"the native builder reads the local Docker engine, not {source}",
                              hint="docker load/pull the image first, or use --builder apptainer")
        if dry_run:
            _native_dry_run(output=output, flavor=flavor, image=image)
            return
        start = time.monotonic()
        size, digest = build_native(tag=image, flavor=flavor, output=Path(output))
        print(f"{output}: {size} bytes ({size / 2**20:.0f} MiB) in "
              f"{time.monotonic() - start:.0f} s\nsystem partition sha256 {digest}", flush=True)


@task
def sif_defs(c):
    """Write apptainer/ddp-FLAVOR.def for every flavor from docker/Dockerfile."""
    ic.APPTAINER_DIR.mkdir(exist_ok=True)
    for flavor in flavors.NAMES:
        ic.apptainer_def(flavor).write_text(apptainer_def.definition(flavor))
        print(f"wrote {ic.apptainer_def(flavor).relative_to(ic.ROOT)}")


TASKS = [sif, sif_defs]
