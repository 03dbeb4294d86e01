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
        from launcher.core.errors import LaunchError

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
    from launcher.core.errors import LaunchError

    raise LaunchError("the SIF has no primary system partition",
                      hint="build it with `invoke sif`; `siftool list FILE` shows its objects")


# --------------------------------------------------------------------- mounting the partition

def mount_point(digest: str, directory: str = "/tmp") -> str:
    """Where the partition is mounted on a node: named after its digest, so jobs that read the
    same bytes share one mount, and a new build never replaces what a running job sees."""
    return f"{directory}/ddp-sif-{digest[:16]}"


def mount_command(sif: str, offset: int, mountpoint: str, foreground: bool = False) -> list[str]:
    """squashfuse mounts the partition read-only where it lies in the SIF (no copy)."""
    return ["squashfuse", *(["-f"] if foreground else []), "-o", f"offset={offset}", sif,
            mountpoint]


def unmount_command(mountpoint: str) -> list[str]:
    """Not lazy: a mount still in use on the node stays (fusermount: busy)."""
    return ["fusermount", "-u", mountpoint]


#: one task on every node of the job, beside the ranks' step (--overlap: it holds no CPUs); the
#: counts are explicit, or the batch environment's SLURM_NTASKS would win over --ntasks-per-node
_ON_EVERY_NODE = ('srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
                  "--ntasks-per-node=1 --mpi=none --overlap")
MOUNT_WAIT_S = 60


def batch_mount_lines(sif: str, offset: int, mountpoint: str) -> list[str]:
    """Batch script lines: every node of the job mounts the partition before the ranks start,
    and unmounts it when the script exits (requeue included). squashfuse runs in the
    foreground, as a job step of its own: a daemon left behind by an ended step would be killed
    with it where Slurm tracks processes by cgroup. A node that has it mounted already (another
    job of the same bytes) shares that mount."""
    where = shlex.quote(mountpoint)
    serve = (f"mkdir -p {where} && {{ mountpoint -q {where} || "
             f"exec {shlex.join(mount_command(sif, offset, mountpoint, foreground=True))}; }}")
    ready = (f"for i in $(seq {MOUNT_WAIT_S}); do mountpoint -q {where} && exit 0; sleep 1; "
             "done; exit 1")
    unmount = f"{_ON_EVERY_NODE} {shlex.join(unmount_command(mountpoint))} 2>/dev/null; wait"
    return [f"{_ON_EVERY_NODE} sh -c {shlex.quote(serve)} &",
            f"trap {shlex.quote(unmount)} EXIT",
            f"{_ON_EVERY_NODE} sh -c {shlex.quote(ready)} || exit 1"]
