"""``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and this launcher's groups.

At DETAIL torch wraps every process group in checks that each collective matches every other
rank's (its ``ProcessGroupWrapper``), run before each collective over a gloo group of their own
that rendezvouses through the wrapped group's store. For gloo and nccl that works, at the price
of a second collective before each one and a gloo connection to every other rank: fine for a
short debugging run, not for a long job (pytorch#148976). The mpi backends have no shared store
(MPI is their rendezvous; torch gets a process-local one), so the wrapper's gloo group waited
out the timeout and the job ended in "Wait timeout": for them DETAIL becomes INFO, recorded as
the launcher's setting, and said once. DDP's own checks stay; a hang is still diagnosed down to
the rank, collective and line (``launcher.faults.hang_watch``).
"""

from __future__ import annotations

import torch.distributed as dist

from launcher.group.backends import MPI4PY
from launcher.mpi.cxx import BACKEND_NAME as MPI_CXX
from launcher.placement import settings

VARIABLE = "TORCH_DISTRIBUTED_DEBUG"
#: the backends that rendezvous through MPI, with no store the ranks share
WITHOUT_STORE = frozenset({MPI4PY, MPI_CXX})


def note(backend: str, detail: bool) -> tuple[bool, str | None]:
    """(whether DETAIL must become INFO for ``backend``, the line to say about it)."""
    if not detail or backend == "mpi":  # torch's own MPI backend it leaves unwrapped
        return False, None
    if backend in WITHOUT_STORE:
        return True, (f"{VARIABLE}=DETAIL checks each collective over a gloo group that needs a "
                      "store every rank shares, and --backend mpi has none (MPI is its "
                      "rendezvous): running at INFO; a hang is still named by rank, collective "
                      "and line; --backend gloo runs torch's checks")
    return False, (f"{VARIABLE}=DETAIL runs a second collective before each one, over a gloo "
                   "group connected to every rank, to compare the ranks' calls: for a short "
                   "debugging run, not a long job")


def settle(backend: str) -> str | None:
    """Before ``backend``'s group starts: lower DETAIL where it cannot work; the line to say."""
    lower, line = note(backend, dist.get_debug_level() == dist.DebugLevel.DETAIL)
    if lower:
        settings.decide(VARIABLE, "INFO", "DETAIL's checks need a store the mpi ranks share")
        dist.set_debug_level(dist.DebugLevel.INFO)
    return line
