"""A SIF file as the runtimes read it, as pure functions: its header and descriptors (the binary
layout of sylabs/sif ``pkg/sif/sif.go``), its primary system partition, and the squashfuse mount
that lets ``ch-run`` start from that partition where it lies in the file.
"""

from __future__ import annotations

import shlex
import struct
from dataclasses import dataclass

from ddp_tasks.sif_content import ARCH_CODES, PART_PRIMSYS, PARTITION

# -------------------------------------------------------------------------- reading a SIF

_HEADER = struct.Struct("<32s10s3s3s16s8q")
_DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s384s")
_PARTITION = struct.Struct("<ii3s")
SIF_MAGIC = b"SIF_MAGIC\0"


@dataclass(frozen=True)
class Descriptor:
    id: int
    datatype: int  # siftool's numbering: 1 Deffile ... 4 Partition ... 6 GenericJSON
    name: str
    offset: int
    size: int
    fstype: int = 0
    parttype: int = 0
    arch: str = ""


def descriptors(head: bytes) -> list[Descriptor]:
    """The used descriptors of a SIF whose first bytes are HEAD (the header and descriptor
    table: ``header_size(...)`` bytes)."""
    fields = _HEADER.unpack_from(head)
    if fields[1] != SIF_MAGIC:
        from launcher.errors import LaunchError

        raise LaunchError("not a SIF file (no SIF_MAGIC in its header)",
                          hint="build one with `invoke sif`")
    total, start = fields[8], fields[9]
    found = []
    for index in range(total):
        (datatype, used, ident, _group, _link, offset, size, *_times, name,
         extra) = _DESCRIPTOR.unpack_from(head, start + index * _DESCRIPTOR.size)
        if not used:
            continue
        part = _PARTITION.unpack_from(extra) if datatype == 0x4000 + PARTITION else (0, 0, b"")
        found.append(Descriptor(ident, datatype - 0x4000, name.rstrip(b"\0").decode(), offset,
                                size, part[0], part[1],
                                _arch_name(int(part[2].rstrip(b"\0") or 0))))
    return found


def _arch_name(code: int) -> str:
    return {value: name for name, value in ARCH_CODES.items()}.get(code, "")


#: bytes that hold the header and a full descriptor table (siftool's default 48 descriptors)
HEAD_BYTES = 4096 + 48 * _DESCRIPTOR.size


def primary_partition(found: list[Descriptor]) -> Descriptor:
    for descriptor in found:
        if descriptor.datatype == PARTITION and descriptor.parttype == PART_PRIMSYS:
            return descriptor
    from launcher.errors import LaunchError

    raise LaunchError("the SIF has no primary system partition",
                      hint="build it with `invoke sif`; `siftool list FILE` shows its objects")


# --------------------------------------------------------------------- mounting the partition

def mount_point(digest: str, directory: str = "/tmp") -> str:
    """Where the partition is mounted on a node: named after its digest, so jobs that read the
    same bytes share one mount, and a new build never replaces what a running job sees."""
    return f"{directory}/ddp-sif-{digest[:16]}"


def mount_command(sif: str, offset: int, mountpoint: str) -> list[str]:
    """squashfuse mounts the partition read-only where it lies in the SIF (no copy)."""
    return ["squashfuse", "-o", f"offset={offset}", sif, mountpoint]


def unmount_command(mountpoint: str) -> list[str]:
    """Not lazy: a mount still in use by another job on the node stays (fusermount: busy)."""
    return ["fusermount", "-u", mountpoint]


def batch_mount_lines(sif: str, offset: int, mountpoint: str) -> list[str]:
    """Lines of a batch script that mount the partition on every node of the job (once per
    node) and unmount it when the script exits, requeue included."""
    on_nodes = "srun --ntasks-per-node=1 --mpi=none"
    mount = (f"mkdir -p {shlex.quote(mountpoint)} && {{ mountpoint -q {shlex.quote(mountpoint)}"
             f" || {shlex.join(mount_command(sif, offset, mountpoint))}; }}")
    unmount = shlex.join(unmount_command(mountpoint))
    return [f"{on_nodes} sh -c {shlex.quote(mount)} || exit 1",
            f"trap {shlex.quote(f'{on_nodes} {unmount} 2>/dev/null')} EXIT"]
