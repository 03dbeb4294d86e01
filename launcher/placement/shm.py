"""Shared memory and locked memory on a node: what the ranks need, what the node gives.

Docker gives a container 64 MiB of ``/dev/shm`` and the engine's memlock limit (8 MiB here).
The bundled MPICH 5.0.2 puts one segment of about 5.2 MiB per rank of a node into
``/dev/shm`` at MPI_Init (measured for 2, 4, 8 and 12 ranks), touched as it starts: 4 ranks in a
16 MiB ``/dev/shm`` end in a segmentation fault, 12 ranks in Docker's 64 MiB hang in MPI_Init
for good. NCCL's shared-memory transport and DataLoader workers need more again (their
buffers and batches; NVIDIA/nccl#290, pytorch#5040), and RDMA registration needs locked
memory (open-mpi/ompi#6468, openucx/ucx#8229).

The size the project's containers get (``docker run --shm-size``, compose ``shm_size``) is
``recommended_shm(ranks per node)``: 256 MiB per rank, at least 1 GiB. ``too_small_for_mpi``
is the certain failure, stopped before MPI starts; ``warnings`` what ``launcher.check``
reports below the recommendation.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from launcher.core.errors import LaunchError

MIB = 1 << 20
#: /dev/shm the bundled MPICH takes per rank of a node (5.2 MiB measured, rounded up)
MPICH_SHM_PER_RANK = 6 * MIB
#: per rank: MPICH's segment, NCCL's shared-memory buffers and DataLoader batches, with room
SHM_PER_RANK = 256 * MIB
SHM_FLOOR = 1024 * MIB
SHM_PATH = "/dev/shm"
UNLIMITED = -1


def recommended_shm(ranks_per_node: int) -> int:
    """Bytes of /dev/shm for a node running ``ranks_per_node`` ranks."""
    return max(SHM_FLOOR, ranks_per_node * SHM_PER_RANK)


def docker_size(size: int) -> str:
    """``size`` bytes as Docker's ``--shm-size`` and compose's ``shm_size`` write it."""
    gib, rest = divmod(size, 1024 * MIB)
    return f"{gib}g" if not rest else f"{-(-size // MIB)}m"


#: the file Docker puts in every container: a memlock HINT names `docker run` only there
DOCKERENV = "/.dockerenv"

@dataclass(frozen=True)
class NodeMemory:
    """What this node gives its ranks: /dev/shm size and free bytes, the memlock limit
    (``UNLIMITED`` = -1)."""

    shm_size: int
    shm_free: int
    memlock: int

    def describe(self) -> str:
        lock = "unlimited" if self.memlock == UNLIMITED else f"{self.memlock // 1024} KiB"
        return (f"/dev/shm {self.shm_size // MIB} MiB ({self.shm_free // MIB} MiB free), "
                f"memlock {lock}")


def read_node_memory(path: str = SHM_PATH) -> NodeMemory:
    """This node's /dev/shm and this process's memlock limit (soft: what it may lock)."""
    try:
        stats = os.statvfs(path)
        size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    except OSError:
        size = free = 0
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return NodeMemory(size, free, UNLIMITED if soft == resource.RLIM_INFINITY else soft)


def _shm_hint(ranks: int) -> str:
    size = docker_size(recommended_shm(ranks))
    return (f"give the container more shared memory: docker run --shm-size={size} (compose: "
            f"shm_size: {size}, `invoke cluster.up` sets it from --procs-per-node), or "
            "--ipc=host; or start fewer ranks per node")


def too_small_for_mpi(local_ranks: int, memory: NodeMemory) -> LaunchError | None:
    """The error for a /dev/shm where the bundled MPICH cannot start ``local_ranks`` ranks
    (it would crash or hang in MPI_Init); None when it fits."""
    need = local_ranks * MPICH_SHM_PER_RANK
    if memory.shm_size >= need:
        return None
    return LaunchError(
        f"/dev/shm holds {memory.shm_size // MIB} MiB, and MPI needs {need // MIB} MiB for "
        f"{local_ranks} ranks on this node ({MPICH_SHM_PER_RANK // MIB} MiB each): MPI_Init "
        "would crash or hang",
        hint=_shm_hint(local_ranks),
    )


def warnings(local_ranks: int, memory: NodeMemory, rdma: bool) -> list[str]:
    """One line per limit below what ``local_ranks`` ranks of this node should have; memlock
    only where it matters, on a node with RDMA devices (``rdma``): TCP locks no memory."""
    found = []
    want = recommended_shm(local_ranks)
    if memory.shm_size < want:
        found.append(
            f"/dev/shm is {memory.shm_size // MIB} MiB, below the {want // MIB} MiB "
            f"recommended for {local_ranks} rank(s) per node (NCCL and DataLoader workers "
            f"fail with bus errors): {_shm_hint(local_ranks)}")
    if rdma and memory.memlock != UNLIMITED:
        container = ("docker run --ulimit memlock=-1 (compose: ulimits: memlock: -1), or "
                     if Path(DOCKERENV).exists() else "")
        found.append(
            f"memlock is limited to {memory.memlock // 1024} KiB: RDMA (InfiniBand, RoCE, "
            f"EFA) cannot register buffers; {container}raise it in "
            "/etc/security/limits.conf")
    return found
