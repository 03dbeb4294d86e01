"""Fill in the rendezvous address and port that the launch environment left open.

``resolve_rendezvous(env)`` returns ``env`` with ``master_addr``/``master_port`` set:

- one process: 127.0.0.1 (unless given) and a free port;
- several processes under an MPI launcher (openmpi, mvapich, pals, hydra): rank 0 picks its
  address -- the IP its host name resolves to, or the host name itself when that IP is loopback
  (the name may still resolve to a reachable address on the other hosts) -- and a free TCP
  port, and broadcasts both over ``MPI.COMM_WORLD``. One allgather of host names also replaces
  the node index and count that ``launcher.detectors`` could only estimate, and fills ``hosts``.
- torchrun and Slurm always provide both, so nothing is done for them.

The port is free when rank 0 picks it; something else may take it before torch binds it, a
window of milliseconds. MPI is started here only through ``launcher.mpi_library.start``, lazily:
detection never starts MPI.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace

from launcher import mpi_library
from launcher.env import JobEnv
from launcher.errors import LaunchError

MPI_LAUNCHERS = frozenset({"openmpi", "mvapich", "pals", "hydra"})


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def reachable_address(hostname: str) -> str:
    """This host's address as other hosts should dial it: IP if not loopback, else the name."""
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        return hostname
    return hostname if ipaddress.ip_address(address).is_loopback else address


def resolve_rendezvous(env: JobEnv) -> JobEnv:
    """``env`` with ``master_addr`` and ``master_port`` filled in (see the module docstring)."""
    if not env.is_distributed:
        return replace(
            env,
            master_addr=env.master_addr or "127.0.0.1",
            master_port=env.master_port or free_port(),
        )
    if env.launcher in MPI_LAUNCHERS:
        return _over_mpi(env)
    if env.master_addr is None or env.master_port is None:
        raise LaunchError(
            f"{env.launcher}: no rendezvous address/port and no MPI launcher to agree on one",
            hint="set MASTER_ADDR (a host every rank can reach) and MASTER_PORT (a free port) "
            "in the environment of every rank",
        )
    return env


def _over_mpi(env: JobEnv) -> JobEnv:
    comm = mpi_library.start(env)
    if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
        raise LaunchError(
            f"the launcher says rank {env.rank} of {env.world_size} ({env.launcher}) but MPI "
            f"says rank {comm.Get_rank()} of {comm.Get_size()}",
            hint="mpi4py loaded a different MPI than the one whose mpiexec/mpirun started the "
            "job: launch with the matching mpiexec, or point mpi4py at that MPI "
            "(MPI4PY_MPIABI=mpich|openmpi|impi, MPI4PY_LIBMPI=/path/to/libmpi.so)",
        )
    picked = None
    if comm.Get_rank() == 0:
        picked = (
            env.master_addr or reachable_address(env.hostname),
            env.master_port or free_port(),
        )
    master_addr, master_port = comm.bcast(picked, root=0)
    names = comm.allgather(env.hostname)
    hosts = tuple(dict.fromkeys(names))  # distinct, in order of their lowest rank
    return replace(
        env,
        master_addr=master_addr,
        master_port=master_port,
        hosts=hosts,
        node_rank=hosts.index(env.hostname),
        num_nodes=len(hosts),
    )
