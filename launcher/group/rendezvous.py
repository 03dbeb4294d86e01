"""Fill in the rendezvous address and port that the launch environment left open.

``resolve_rendezvous(env)`` returns ``env`` with ``master_addr``/``master_port`` set:

- one process: 127.0.0.1 (unless given) and a free port;
- several processes under an MPI launcher (openmpi, mvapich, pals, hydra): rank 0 picks its
  address -- the one the ranks of the other nodes resolve its host name to and this node holds
  (its own node may resolve the name to 127.0.1.1, or to its address on another network); on
  one node the IP its name resolves to, or the name itself when that is loopback -- and a free
  TCP port, and broadcasts both over ``MPI.COMM_WORLD``. One allgather of host names also
  replaces the node index and count that ``launcher.placement.detectors`` could only estimate, and
  fills ``hosts``.
- torchrun and Slurm always provide both, so nothing is done for them.

``start_store`` then starts the TCP store on rank 0 and connects the others to it (under
torchrun every rank joins the store its agent already serves, where it does). A rank that
is not rank 0 keeps trying while nothing listens yet (rank 0 may start later), but stops at once
when something answers that is not a store: another program holds the port, and rank 0, unable
to bind it, has stopped already. An attempt that times out is a store answering late (rank 0 on
a loaded node) and is made again, until the rendezvous timeout.

The port is free when rank 0 picks it; something else may take it before torch binds it, a
window of milliseconds. MPI is started here only through ``launcher.mpi.library.start``, lazily:
detection never starts MPI.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults.c10d_log import quiet_c10d
from launcher.faults.peer_lost import HOST_KEY, first_line
from launcher.group.backends import rendezvous_over_mpi
from launcher.mpi import library as mpi_library
from launcher.mpi import segments as mpi_segments
from launcher.placement import network, shm
from launcher.placement.env import JobEnv, planned_network

#: where the ranks of other nodes publish the address they reach the rendezvous host at
SEEN_KEY = "ddp/network/rendezvous-seen-as"
#: seconds of one attempt to reach rank 0's store; a store answers within milliseconds
CONNECT_ATTEMPT_S = 3.0


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


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


def resolve_rendezvous(env: JobEnv, world=None) -> JobEnv:
    """``env`` with ``master_addr`` and ``master_port`` filled in (see the module docstring);
    ``world``: ``MPI.COMM_WORLD`` when the caller started MPI already (``start_mpi``)."""
    if not env.is_distributed:
        return replace(
            env,
            master_addr=env.master_addr or "127.0.0.1",
            master_port=env.master_port or free_port(),
        )
    if rendezvous_over_mpi(env):
        return _over_mpi(env, world if world is not None else start_mpi(env))
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


def _over_mpi(env: JobEnv, comm) -> JobEnv:
    if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
        raise LaunchError(
            f"the launcher says rank {env.rank} of {env.world_size} ({env.launcher}) but MPI "
            f"says rank {comm.Get_rank()} of {comm.Get_size()}",
            hint="mpi4py loaded a different MPI than the one whose mpiexec/mpirun started the "
            "job: launch with the matching mpiexec, or point mpi4py at that MPI "
            "(MPI4PY_MPIABI=mpich|openmpi|impi, MPI4PY_LIBMPI=/path/to/libmpi.so)",
        )
    names = comm.allgather(env.hostname)
    # how the other nodes see rank 0: its own node may resolve its name to loopback, or to its
    # address on a network the others do not share
    seen = comm.gather(resolve(names[0]) if env.hostname != names[0] else None, root=0)
    picked = None
    if comm.Get_rank() == 0:
        picked = (
            env.master_addr or reachable_address(env.hostname, seen),
            env.master_port or free_port(),
        )
    master_addr, master_port = comm.bcast(picked, root=0)
    hosts = tuple(dict.fromkeys(names))  # distinct, in order of their lowest rank
    return replace(
        env,
        master_addr=master_addr,
        master_port=master_port,
        hosts=hosts,
        node_rank=hosts.index(env.hostname),
        num_nodes=len(hosts),
    )


def start_store(env: JobEnv, backend: str, timeout: timedelta,
                world=None) -> tuple[JobEnv, dist.Store]:
    """The TCP store hosted by rank 0: torch's rendezvous, and after a failure the roll call
    (it outlives a broken group and tells which ranks still answer)."""
    env = resolve_rendezvous(env, world)
    try:
        if env.rank == 0 and not _agent_store_listens(env):
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                  is_master=True, timeout=timeout, multi_tenant=True)
        else:
            store = _connect(env, timeout)
        store.set(f"{HOST_KEY}/{env.rank}", env.hostname)
        env = _choose_network(env, store)
    except (RuntimeError, ValueError) as exc:
        raise rendezvous_error(env, backend, exc) from None
    return env, store


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


def _agent_store_listens(env: JobEnv) -> bool:
    """Whether torchrun's agent already serves the store at the rendezvous address: it binds
    it before it starts the workers (TORCHELASTIC_USE_AGENT_STORE), and a rank 0 that binds it
    again gets an error logged by torch (which then joins as a client anyway). Ranks started
    by hand with RANK and MASTER_PORT (no agent: no TORCHELASTIC_RUN_ID) host it themselves."""
    if env.launcher != "torchrun" or env.job_id is None:
        return False
    try:
        socket.create_connection((env.master_addr, env.master_port), timeout=1).close()
    except OSError:
        return False
    return True


def _connect(env: JobEnv, timeout: timedelta) -> dist.Store:
    """A client of rank 0's store, once something listens at its address (until ``timeout``).

    Waiting for the listener happens here, quietly: torch's client logs every failed attempt
    with a C++ stack. What then answers gets bounded attempts: torch's own client retries for
    its whole timeout when that is not a store, and hangs for good when it accepts and never
    replies. Only an attempt that timed out is made again (rank 0's store, slow on a loaded
    node); a reply that is not a store's, or none at all, is named at once.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((env.master_addr, env.master_port), timeout=1).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rank {env.rank}: nothing listens at {env.master_addr}:{env.master_port} "
                    f"after {timeout.total_seconds():.0f} s ({exc}): rank 0 did not start the "
                    "rendezvous (look at its error), or this node cannot reach it",
                    hint=_port_hint(env)) from None
            time.sleep(0.2)
    while True:
        outcome = _attempt(env)
        if isinstance(outcome, dist.Store):
            outcome.set_timeout(timeout)
            return outcome
        # a store that answers late (rank 0 on a loaded node) times out; a program that is
        # not a store hangs the attempt or answers with something else
        if not _timed_out(outcome) or time.monotonic() > deadline:
            raise _foreign_listener(env, outcome)


def _attempt(env: JobEnv) -> dist.Store | Exception | None:
    """One bounded try at rank 0's store: the store, torch's error, or None when what answers
    accepted and never replied (torch's client would then wait for good)."""
    outcome: list = []

    def attempt() -> None:
        try:
            outcome.append(dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                         is_master=False,
                                         timeout=timedelta(seconds=CONNECT_ATTEMPT_S)))
        except (RuntimeError, ValueError) as exc:
            outcome.append(exc)

    # a store answers the first try; anything else would be logged with a C++ stack per retry
    with quiet_c10d():
        thread = threading.Thread(target=attempt, name="ddp-rendezvous", daemon=True)
        thread.start()
        thread.join(CONNECT_ATTEMPT_S + 3)
    return outcome[0] if outcome else None


def _timed_out(outcome: Exception | None) -> bool:
    return outcome is not None and "timed out" in first_line(outcome).lower()


def _foreign_listener(env: JobEnv, error: Exception | None) -> LaunchError:
    what = first_line(error) if error is not None else "accepted, then no reply"
    return LaunchError(
        f"rank {env.rank}: {env.master_addr}:{env.master_port} answers, but not as rank 0's "
        f"rendezvous store ({what}): another program holds the port, so rank 0 could not "
        "start the rendezvous there",
        hint=_port_hint(env),
    )


def _port_hint(env: JobEnv) -> str:
    return (f"set MASTER_PORT to a port free on {env.master_addr} in every rank's environment "
            "(under Slurm the port is derived from the job and step ids, outside the node's "
            "ephemeral range: run the step again, it gets another)")


def rendezvous_error(env: JobEnv, backend: str, exc: Exception) -> LaunchError:
    """The rendezvous failed: say where, and what to check."""
    where = f"{env.master_addr}:{env.master_port}"
    text = first_line(exc)
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        hint = _port_hint(env)
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
