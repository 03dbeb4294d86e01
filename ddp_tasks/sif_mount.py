"""A built SIF on this machine: its descriptors and partition digest read from the file, and
its system partition mounted read-only with squashfuse for ``ch-run`` (pure parts in
``ddp_tasks.sif_file``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ddp_tasks import sif_file
from launcher.core.errors import LaunchError

MOUNT_TOOLS = {"squashfuse": "squashfuse", "fusermount": "fuse"}


def require(tools: dict[str, str], purpose: str) -> None:
    """LaunchError naming the Debian packages of the TOOLS (program: package) not installed."""
    missing = [program for program in tools if shutil.which(program) is None]
    if missing:
        packages = " ".join(sorted({tools[program] for program in missing}))
        raise LaunchError(f"{purpose} needs {', '.join(missing)}, not installed",
                          hint=f"apt-get install {packages} (Debian 12 has them; "
                               "./scripts/bootstrap.sh --system installs them)")


def sha256_of(path: Path, offset: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        stream.seek(offset)
        left = os.path.getsize(path) - offset if size is None else size
        while left > 0:
            chunk = stream.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def read_descriptors(path: Path) -> list[sif_file.Descriptor]:
    if not path.is_file():
        raise LaunchError(f"SIF file {path} does not exist",
                          hint="build it with `invoke sif` (or give --image PATH.sif)")
    with open(path, "rb") as stream:
        return sif_file.descriptors(stream.read(sif_file.HEAD_BYTES))


def partition_of(path: Path) -> tuple[int, int, str]:
    """``(offset, size, sha256)`` of the SIF's primary system partition."""
    part = sif_file.primary_partition(read_descriptors(path))
    return part.offset, part.size, sha256_of(path, part.offset, part.size)


@contextmanager
def mounted(path: Path, mountpoint: Path | None = None):
    """The SIF's system partition mounted read-only (squashfuse at its offset), unmounted after;
    yields the mount point, a root file system for ``ch-run``."""
    require(MOUNT_TOOLS, "running from a SIF with Charliecloud")
    offset, _, digest = partition_of(path)
    where = mountpoint or Path(sif_file.mount_point(digest, tempfile.gettempdir()))
    where.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(where):  # another run reads the same bytes: share its mount
        yield where
        return
    subprocess.run(sif_file.mount_command(str(path), offset, str(where)), check=True, timeout=60)
    try:
        yield where
    finally:
        _unmount(where)


def _unmount(where: Path, attempts: int = 20) -> None:
    """fusermount fails while ranks that just ended still hold files; retry for a few s."""
    for _ in range(attempts):
        unmount = subprocess.run(sif_file.unmount_command(str(where)), capture_output=True)
        if unmount.returncode == 0:
            break
        time.sleep(0.5)
    else:
        print(f"warning: {where} is still in use; unmount it with fusermount -u {where}",
              file=sys.stderr)
        return
    where.rmdir()
