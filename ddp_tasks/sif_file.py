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
    """Where the partition is mounted on a node: named after its digest, so that runs of
    ``invoke run`` that read the same bytes share one mount, and a new build never replaces
    what a running job sees (a batch job's is its own: ``batch_mount_point``)."""
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


def batch_mount_point(mountpoint: str) -> str:
    """``mountpoint`` of this job and attempt, as the batch script's shell expands it. Never
    shared with another job: one job's end would unmount it under the other's ranks, or wait
    for it (busy) until the time limit, and another user may not enter it."""
    return f"{mountpoint}-$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"


#: how the batch script's lines name the mount point, which ``batch_mount_lines`` sets
IN_SCRIPT = "$sif_mount"


def batch_mount_lines(sif: str, offset: int, mountpoint: str, ignore: str) -> list[str]:
    """Batch script lines: every node of the job mounts the partition before the ranks start,
    and unmounts it when the script exits; the step that served it then removes its directory,
    as it does when Slurm ends it first (a requeue). squashfuse runs in the
    foreground, as a job step of its own: a daemon left behind by an ended step would be killed
    with it where Slurm tracks processes by cgroup. Slurm sends the preemption signal
    ``ignore`` to every step, this one too (no "B:"), and squashfuse would die of it, its
    mount with it, as the ranks write their checkpoint: it ignores that signal. Nodes of the
    job that share one /tmp (several slurmd on one host) share one mount."""
    mount = [*map(shlex.quote, mount_command(sif, offset, "", foreground=True)[:-1]), '"$1"']
    # sh outlives a TERM (Slurm ending the step) to remove the directory once squashfuse,
    # which has TERM's default and so libfuse's handler, has unmounted and ended
    survive = "" if ignore == "TERM" else " trap : TERM;"
    serve = (f"trap \"\" {ignore};{survive} mkdir -p \"$1\" && "
             f"{{ mountpoint -q \"$1\" || {{ {' '.join(mount)}; rmdir \"$1\"; }}; }}")
    ready = (f"for i in $(seq {MOUNT_WAIT_S}); do mountpoint -q \"$1\" && exit 0; sleep 1; "
             "done; exit 1")
    unmount = " ".join(unmount_command('"$1"'))
    unmount = f"{_on_every_node(unmount)} 2>/dev/null; wait"
    return [f"sif_mount=\"{batch_mount_point(mountpoint)}\"", _UNEXPANDED,
            f"{_on_every_node(serve)} &",
            f"trap {shlex.quote(unmount)} EXIT", _UNEXPANDED,
            f"{_on_every_node(ready)} || exit 1"]


#: before each ``sh -c '...$1...'`` line: the single quotes are meant, sh expands ``$1``
_UNEXPANDED = "# shellcheck disable=SC2016"


def _on_every_node(command: str) -> str:
    """``command`` in sh on every node of the job, the mount point its ``$1``."""
    return f"{_ON_EVERY_NODE} sh -c {shlex.quote(command)} sh \"{IN_SCRIPT}\""
