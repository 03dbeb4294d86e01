"""MPI's single-copy transfers (CMA) between a node's ranks, switched as the node found they
work (``launcher.mpi.cma``), for the libraries whose switch the launcher knows.

The bundled MPIs (the image's MPICH and Open MPI 5, the venv's MPICH) are switched on or off;
a host Open MPI before 5 bound in is switched off where CMA fails (on, it keeps its own
choice); other host MPIs keep their own rules: their variables may mean something else, and
Intel MPI and Open MPI 5 cope with ranks in separate user namespaces by themselves
(tests/test_cma.py). The user's own setting wins and is not probed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.mpi import cma, huge_pages
from launcher.placement import settings
from launcher.placement.env import JobEnv

#: a library's switch: its variable and values (on, off); on None: the MPI's own choice
Switch = tuple[str, str | None, str]

#: the bundled MPIs' switches, by ABI
CMA_VARIABLE = "MPIR_CVAR_CH4_CMA_ENABLE"
SMSC_VARIABLE = "OMPI_MCA_smsc"
BUNDLED: dict[str, Switch] = {"mpich": (CMA_VARIABLE, "1", "0"),
                              "openmpi": (SMSC_VARIABLE, "cma", "^cma")}
#: a host Open MPI before 5 (ORTE's library beside its libmpi): its vader transport's single
#: copy. Across user namespaces Open MPI 4.1.8 warns that CMA "is not available" and falls back
#: to a mechanism whose 4 MiB all_reduce never completes (tests/test_cma.py); "none" works.
#: Where CMA works it keeps its own choice (XPMEM or KNEM where it has them)
VADER: Switch = ("OMPI_MCA_btl_vader_single_copy_mechanism", None, "none")
_ORTE = "libopen-rte.so.40"
#: the transports UCX may use (the bundled MPICH's netmod): all but its POSIX shared memory
#: where a node's ranks are in several user namespaces. Its peers' segments are opened through
#: /proc/PID/fd, which another user namespace may not do: one "mm_posix.c ... UCX ERROR
#: open(/proc/...) failed: Permission denied" line on stdout per connection. SysV shared memory
#: instead, which the kernel frees when the last rank detaches, however it ends (named POSIX
#: segments, UCX_POSIX_USE_PROC_LINK=n, stay in /dev/shm after a rank is killed)
UCX_TLS, UCX_WITHOUT_POSIX = "UCX_TLS", "^posix"


def switch(abi: str, path: str, bundled: bool) -> Switch | None:
    """The switch of the libmpi at ``path`` (``bundled``: one of the project's), or None where
    the launcher leaves the library's rules alone."""
    if bundled:
        return BUNDLED[abi]
    if abi == "openmpi" and path and (Path(path).parent / _ORTE).exists():
        return VADER
    return None


def decide(env: JobEnv, chosen: Switch) -> None:
    """Turn CMA on or off as this node's ranks found it works; when off, local rank 0 says why
    and what it costs, in one line.

    Only for MPI launches with several ranks on the node: one rank has no peer to copy from.
    Where on, torch's large CPU buffers go into huge pages (``launcher.mpi.huge_pages``).
    The user's own setting wins and is not probed (the transfer check in
    launcher/mpi/backend.py still stops wrong sums). Ours goes into the environment, which
    processes the rank starts later inherit (they do not probe for peers that are gone: the
    ``MPI4PY_LIBMPI`` they inherit is the user's choice to them).
    """
    variable, on, off = chosen
    if settings.user_value(variable) is not None or env.pmi == "none" or env.local_world_size < 2:
        return
    decision = cma.node_decision(env)
    line = decision.line(env)
    value = on if decision.on else off
    if value is not None:
        settings.decide(variable, value, line)
    if decision.on and value is not None:  # not where a host MPI keeps its own mechanism
        huge_pages.prefer()
    if not decision.one_namespace:
        settings.prefer(UCX_TLS, UCX_WITHOUT_POSIX, "the node's ranks are in several user "
                        "namespaces, which cannot open each other's POSIX shared memory "
                        "through /proc: UCX's SysV shared memory instead")
    if env.local_rank == 0 and not decision.on:  # on is the rule: launcher.check says it
        print(line, file=sys.stderr, flush=True)


def decided() -> tuple[bool, str] | None:
    """This process's CMA decision as ``decide`` recorded it: (on, its line); None where none
    was made (the user's setting, one rank on the node, no MPI launch)."""
    for setting in settings.applied():
        for variable, on, _off in (*BUNDLED.values(), VADER):
            if setting["name"] == variable and setting["source"] == "launcher":
                return setting["value"] == on, setting["why"]
    return None
