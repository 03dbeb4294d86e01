"""Fill in the rendezvous address and port that the launch environment left open.

``resolve_rendezvous(env)`` returns ``env`` with ``master_addr``/``master_port`` set:

- one process: 127.0.0.1 (unless given) and a port (``pick_port``, below);
- several processes under an MPI launcher (openmpi, mvapich, pals, hydra): rank 0 picks its
  address -- the one the ranks of the other nodes resolve its host name to and this node holds
  (its own node may resolve the name to 127.0.1.1, or to its address on another network); on
  one node the IP its name resolves to, or the name itself when that is loopback -- and a
  TCP port (``pick_port``), and broadcasts both over ``MPI.COMM_WORLD``. One allgather of host
  names also replaces the node index and count that ``launcher.placement.detectors`` could
  only estimate, and fills ``hosts``; the mpi backend, which needs no address, gets the same
  allgather alone (``nodes_over_mpi``).
- torchrun and Slurm always provide both, so nothing is done for them.

``start_store`` then starts the TCP store on rank 0 and connects the others to it (under
torchrun every rank joins the store its agent already serves, where it does, and which
outlives the agent's restarts: each attempt keeps to its own prefix, ``JobEnv.store_prefix``,
and torch's rendezvous goes through it too). A rank that
is not rank 0 keeps trying while nothing listens yet (rank 0 may start later), but stops at once
when something answers that is not a store: another program holds the port, and rank 0, unable
to bind it, has stopped already. An attempt that times out is a store answering late (rank 0 on
a loaded node) and is made again, until the rendezvous timeout.

Where rank 0 picks the port, ``start_store`` binds the store to a port the kernel chooses and
only then tells the others (``pick_port``): a port picked free and bound later could be taken
in between by another program, which happened in CI with a few hundred jobs on one machine.
MPI is started here only through ``launcher.mpi.library.start``, lazily: detection never starts
MPI.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults.peer_lost import HOST_KEY, first_line
from launcher.group.backends import rendezvous_over_mpi
from launcher.group.store_client import agent_store_listens, connect, port_hint
from launcher.mpi import library as mpi_library
from launcher.mpi import segments as mpi_segments
from launcher.placement import network, shm
from launcher.placement.env import JobEnv, planned_network
from launcher.placement.ports import ephemeral_warning, free_port

#: where the ranks of other nodes publish the address they reach the rendezvous host at
SEEN_KEY = "ddp/network/rendezvous-seen-as"


def resolve(hostname: str) -> str | None:
    """The IPv4 address ``hostname`` resolves to on this node, or None."""
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return None


def reachable_address(hostname: str, seen_by_peers: list[str | None] = ()) -> str:
    """This host's address as other hosts should dial it: the one they resolve its name to
    and it holds; else its IP if not loopback; else the name (other hosts may resolve it)."""
    own = [a for a in seen_by_peers
           if a and not network.is_loopback(a) and network.interface_of(a)]
    if own:
        return max(set(own), key=own.count)
    address = resolve(hostname)
    if address is None:
        return hostname
    return hostname if ipaddress.ip_address(address).is_loopback else address


def resolve_rendezvous(env: JobEnv, world=None, pick_port=None) -> JobEnv:
    """``env`` with ``master_addr`` and ``master_port`` filled in (see the module docstring);
    ``world``: ``MPI.COMM_WORLD`` when the caller started MPI already (``start_mpi``);
    ``pick_port(address)``: how rank 0 gets a port where none is given (``free_port``), None
    when it could not (each rank's ``master_port`` is then None)."""
    pick_port = pick_port or (lambda address: free_port())
    if not env.is_distributed:
        master_addr = env.master_addr or "127.0.0.1"
        return replace(env, master_addr=master_addr,
                       master_port=env.master_port or pick_port(master_addr))
    if rendezvous_over_mpi(env):
        return _over_mpi(env, world if world is not None else start_mpi(env), pick_port)
    if env.master_addr is None or env.master_port is None:
        raise LaunchError(
            f"{env.launcher}: no rendezvous address/port and no MPI launcher to agree on one",
            hint="set MASTER_ADDR (a host every rank can reach) and MASTER_PORT (a free port) "
            "in the environment of every rank",
        )
    return env


def start_mpi(env: JobEnv):
    """``MPI.COMM_WORLD`` (``mpi_library.start``), after the checks that MPI cannot make. The
    process group calls it once and hands the world on (``resolve_rendezvous``, ``start_store``)."""
    choice = mpi_library.load(env)
    if choice.bundled_mpich:
        error = shm.too_small_for_mpi(env.local_world_size, shm.read_node_memory())
        if error is not None:
            raise error
    abi = ("mpich" if choice.bundled_mpich
           else "openmpi" if choice.path == str(mpi_library.BUNDLED_OPENMPI) else "")
    try:
        planned = planned_network(env)
    except LaunchError:
        planned = None  # the store's rendezvous says why, or the peers tell rank 0's address
    if planned is not None and abi:
        network.apply(planned, abi)
    comm = mpi_library.start(env)
    mpi_segments.unlink_mapped(comm)  # nothing left in /dev/shm, however the job ends
    return comm


def nodes_over_mpi(env: JobEnv, comm) -> JobEnv:
    """``env`` with the node index, count and list of one allgather of host names over
    ``comm`` (``MPI.COMM_WORLD``), for the mpi backend, which starts no store: an MPI
    launcher names no node, and the detectors' estimate (nodes filled alike) differs between
    the ranks of unevenly filled ones (3 ranks on one host, 1 on another: node 3 of 4 and node
    0 of 2). Each rank receives every rank's name, O(N) bytes (a few MB at 100,000 ranks), once
    at start-up."""
    if not rendezvous_over_mpi(env):
        return env  # Slurm numbers its nodes; one process has one
    return _on_hosts(env, _host_names(env, comm))


def _host_names(env: JobEnv, comm) -> list[str]:
    """Every rank's host name, in rank order, after checking that MPI sees the launcher's
    ranks."""
    if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
        raise LaunchError(
            f"the launcher says rank {env.rank} of {env.world_size} ({env.launcher}) but MPI "
            f"says rank {comm.Get_rank()} of {comm.Get_size()}",
            hint="mpi4py loaded a different MPI than the one whose mpiexec/mpirun started the "
            "job: launch with the matching mpiexec, or point mpi4py at that MPI "
            "(MPI4PY_MPIABI=mpich|openmpi|impi, MPI4PY_LIBMPI=/path/to/libmpi.so)",
        )
    return comm.allgather(env.hostname)


def _on_hosts(env: JobEnv, names: list[str]) -> JobEnv:
    hosts = tuple(dict.fromkeys(names))  # distinct, in order of their lowest rank
    return replace(env, hosts=hosts, node_rank=hosts.index(env.hostname), num_nodes=len(hosts))


def _over_mpi(env: JobEnv, comm, pick_port) -> JobEnv:
    names = _host_names(env, comm)
    # how the other nodes see rank 0: its own node may resolve its name to loopback, or to its
    # address on a network the others do not share
    seen = comm.gather(resolve(names[0]) if env.hostname != names[0] else None, root=0)
    picked = None
    if comm.Get_rank() == 0:
        address = env.master_addr or reachable_address(env.hostname, seen)
        picked = (address, env.master_port or pick_port(address))
    master_addr, master_port = comm.bcast(picked, root=0)
    return replace(_on_hosts(env, names), master_addr=master_addr, master_port=master_port)


def start_store(env: JobEnv, backend: str, timeout: timedelta,
                world=None) -> tuple[JobEnv, dist.Store]:
    """The TCP store hosted by rank 0: torch's rendezvous, and after a failure the roll call
    (it outlives a broken group and tells which ranks still answer)."""
    hosted = _HostedStore(env.world_size, timeout)
    env = resolve_rendezvous(env, world, hosted)
    try:
        if hosted.error is not None:
            raise hosted.error
        if env.master_port is None:
            raise RuntimeError("rank 0 could not start the store on any port (its own error "
                               "says why)")
        if hosted.store is not None:
            store = hosted.store
        elif env.rank == 0 and not agent_store_listens(env):
            # a port the launcher derived lies outside the range: this one was given
            if (line := ephemeral_warning(env.master_port)) is not None:
                print(f"warning: {line}", file=sys.stderr, flush=True)
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                  is_master=True, timeout=timeout, multi_tenant=True)
        else:
            store = connect(env, timeout)
        if env.store_prefix:
            store = dist.PrefixStore(env.store_prefix, store)  # holds the server (rank 0's)
        store.set(f"{HOST_KEY}/{env.rank}", env.hostname)
        env = _choose_network(env, store)
    except (RuntimeError, ValueError) as exc:
        raise rendezvous_error(env, backend, exc) from None
    return env, store


class _HostedStore:
    """Rank 0's way to pick the port when none is given (``resolve_rendezvous``'s
    ``pick_port``): its store, bound to a port the kernel picks, so no other program can take
    it before the ranks are told. A failure is kept in ``error``, raised once every rank knows."""

    def __init__(self, world_size: int, timeout: timedelta) -> None:
        self._world_size, self._timeout = world_size, timeout
        self.store: dist.TCPStore | None = None
        self.error: Exception | None = None

    def __call__(self, address: str) -> int | None:
        try:
            self.store = dist.TCPStore(address, 0, self._world_size, is_master=True,
                                       timeout=self._timeout, wait_for_workers=False)
        except (RuntimeError, ValueError) as exc:
            self.error = exc
            return None
        return self.store.port


def _choose_network(env: JobEnv, store: dist.Store) -> JobEnv:
    """The interface towards rank 0's address, for gloo and NCCL. Where that route is
    loopback (rank 0's node, whose name may resolve to 127.0.1.1 there), the address the ranks
    of the other nodes reached it at: the first rank of node 1 publishes it, or "" when its
    node is rank 0's machine (several Slurm nodes on one host), where loopback serves."""
    spans = env.num_nodes > 1
    seen = None
    if spans and env.node_rank != 0:
        spans = store.get(f"{HOST_KEY}/0").decode() != env.hostname
        if env.node_rank == 1 and env.local_rank == 0:
            store.set(SEEN_KEY, (resolve(env.master_addr) or "") if spans else "")
    elif spans and not env.ifname and network.loops_back(env.master_addr):
        seen = store.get(SEEN_KEY).decode() or None
        spans = seen is not None
    choice = network.choose(env.ifname, env.master_addr, spans, seen_by_peers=seen)
    network.apply(choice, "")
    return replace(env, network=choice)


def rendezvous_error(env: JobEnv, backend: str, exc: Exception) -> LaunchError:
    """The rendezvous failed: say where, and what to check."""
    where = f"{env.master_addr}:{env.master_port}"
    text = first_line(exc)
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        hint = port_hint(env)
    else:
        hint = (
            f"check that every node can reach {where} (firewall, hostname resolution); on "
            "machines with several interfaces set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; or "
            "use --backend mpi (launcher.distributed(backend=\"mpi\") in your own script), "
            "which needs no address"
        )
    return LaunchError(
        f"rank {env.rank} could not join the {backend} process group at {where} "
        f"(launcher {env.launcher}): {text}",
        hint=hint,
    )
