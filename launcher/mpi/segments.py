"""MPICH's shared-memory segments lose their names once every rank has mapped them.

MPICH creates one segment per node in ``/dev/shm`` (``mpich_shm_<hash>_<n>``) at MPI_Init and
removes it in MPI_Finalize only. A job that ends otherwise (``MPI_Abort`` after a failure or a
lost peer, a rank killed) left it behind: after one CI run and a few fault runs, 51 files and
105 MB of RAM that only a reboot returns, and a later job whose id hashes to the same name
attached to the stale segment and failed in MPI_Init ("Message truncated"). So once every rank
has mapped its node's segment, each rank removes the names of those it maps: the memory stays
mapped and in use, and the kernel frees it when the last rank of the node exits, however that
happens. Only segments this process maps are touched, never another job's; MPI_Finalize's own
removal then finds nothing to do.
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"
_DELETED = " (deleted)"


def unlink_mapped(comm, maps: Path = Path("/proc/self/maps")) -> None:
    """Collective over ``comm`` (MPI_COMM_WORLD): remove the names of the MPICH segments this
    process maps, after every rank has mapped its own."""
    comm.Barrier()
    for path in mapped(maps.read_text()):
        with suppress(FileNotFoundError):  # another rank of this node was first
            os.unlink(path)


def mapped(maps_text: str) -> list[str]:
    """The MPICH segments in ``/proc/<pid>/maps`` text that still have a name."""
    found = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if (os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(PREFIX)
                and not path.endswith(_DELETED)):
            found.append(path)
    return sorted(set(found))
