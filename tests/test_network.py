"""The interface choice (launcher.placement.network), on this machine's real interfaces and
routes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from launcher.core.errors import LaunchError
from launcher.group.rendezvous import reachable_address
from launcher.placement import network
from launcher.placement.env import detect_environment, network_target, planned_network
from tests.fixtures.mpi import REPO_ROOT


def _outward() -> tuple[str, str] | None:
    """(interface, address) of a non-loopback interface of this machine, or None."""
    for _index, name in socket.if_nameindex():
        address = network.interface_address(name)
        if address and not network.is_loopback(address):
            return name, address
    return None


def test_loopback_is_found_through_the_kernel():
    assert network.interface_address("lo") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_address("no-such-if0") is None
    assert network.source_address("127.0.0.1") == "127.0.0.1"


def test_an_address_of_this_node_routes_to_its_own_interface():
    found = _outward()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    choice = network.choose(None, address, spans_nodes=True)
    assert (choice.ifname, choice.address) == (name, address)
    assert choice.reason == f"route to {address}"


def test_one_node_may_use_loopback():
    choice = network.choose(None, "localhost", spans_nodes=False)
    assert (choice.ifname, choice.address) == ("lo", "127.0.0.1")


def test_loopback_across_nodes_is_refused_with_a_hint():
    # Debian maps a machine's own name to 127.0.1.1
    with pytest.raises(LaunchError, match="loopback") as caught:
        network.choose(None, "127.0.1.1", spans_nodes=True)
    assert "MASTER_ADDR" in caught.value.hint and "--ifname" in caught.value.hint


def test_the_address_peers_reach_wins_over_a_loopback_route():
    found = _outward()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    choice = network.choose(None, "127.0.1.1", spans_nodes=True, seen_by_peers=address)
    assert (choice.ifname, choice.address) == (name, address)


def test_the_users_interface_wins():
    choice = network.choose("lo", "127.0.1.1", spans_nodes=True)
    assert (choice.ifname, choice.reason) == ("lo", "set by the user")


@pytest.mark.parametrize(("ifname", "message"), [
    ("^lo,docker0", "GLOO_SOCKET_IFNAME=^lo,docker0: gloo takes interface names, not NCCL's '^' "
                    "syntax (NCCL_SOCKET_IFNAME may keep it)"),
    ("=lo", "GLOO_SOCKET_IFNAME==lo: gloo takes interface names, not NCCL's '=' "
             "syntax (NCCL_SOCKET_IFNAME may keep it)"),
    ("eht0", "GLOO_SOCKET_IFNAME=eht0: this node has no interface eht0"),
    ("lo,eht0", "GLOO_SOCKET_IFNAME=lo,eht0: this node has no interface eht0"),
    ("lo, lo", "GLOO_SOCKET_IFNAME='lo, lo': an empty name or spaces around one (gloo splits "
               "the list on commas alone)"),
    ("lo,", "GLOO_SOCKET_IFNAME='lo,': an empty name or spaces around one (gloo splits the "
            "list on commas alone)"),
])
def test_a_users_interface_this_node_lacks_is_one_error_naming_its_interfaces(ifname, message):
    with pytest.raises(LaunchError) as raised:
        network.choose(ifname, "127.0.0.1", spans_nodes=False)
    assert raised.value.message == message
    assert raised.value.hint.startswith("name the interface the nodes share with --ifname")
    names = [name for _, name in socket.if_nameindex()]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    assert raised.value.hint.endswith(f"has {shown}")


def test_gloos_list_of_interfaces_is_taken_its_first_names_the_address():
    choice = network.choose("lo,lo", None, spans_nodes=True)
    assert (choice.ifname, choice.address) == ("lo,lo", "127.0.0.1")


def test_no_target_no_choice_yet():
    assert network.choose(None, None, spans_nodes=True) is None


def test_an_unknown_host_is_one_error():
    with pytest.raises(LaunchError, match="no route to no-such-host.invalid"):
        network.choose(None, "no-such-host.invalid", spans_nodes=True)


def test_every_library_gets_the_same_interface():
    choice = network.NetworkChoice("eth1", "10.0.0.2", "route to n0")
    assert network.variables(choice, "", rdma=False) == {
        "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    mpich = network.variables(choice, "mpich", rdma=False)
    assert {mpich[n] for n in ("UCX_NET_DEVICES", "FI_TCP_IFACE", "FI_SOCKETS_IFACE")} == {"eth1"}
    # UCX_NET_DEVICES=eth1 would turn InfiniBand off
    assert "UCX_NET_DEVICES" not in network.variables(choice, "mpich", rdma=True)
    openmpi = network.variables(choice, "openmpi", rdma=False)
    assert openmpi["OMPI_MCA_btl_tcp_if_include"] == "eth1"
    assert openmpi["OMPI_MCA_oob_tcp_if_include"] == "eth1"


def test_the_users_variables_win(monkeypatch):
    # apply() writes os.environ: a private copy, so that nothing it sets reaches the ranks
    # that later tests start (monkeypatch.delenv does not record a name that was not set)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in (
        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include",
        "OMPI_MCA_oob_tcp_if_include")})
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker0")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_exclude", "lo,docker0")
    applied = network.apply(network.NetworkChoice("eth1", "", "route to n0"), "openmpi")
    assert applied["NCCL_SOCKET_IFNAME"] == "^docker0"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"
    # Open MPI refuses both lists for one component
    assert "OMPI_MCA_btl_tcp_if_include" not in os.environ
    assert applied["OMPI_MCA_oob_tcp_if_include"] == "eth1"


def test_rank_0_advertises_the_address_the_other_nodes_resolve_it_to():
    found = _outward()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    _name, address = found
    # its own name resolves to loopback here, the other nodes see its real address
    assert reachable_address("localhost", [None, address, address]) == address
    # an address this node does not hold is not its own
    assert reachable_address("localhost", [None, "192.0.2.77"]) == "localhost"


def test_a_node_whose_name_is_loopback_routes_to_another_node():
    found = _outward()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
               "MASTER_ADDR": "127.0.1.1", "DDP_HOSTS": f"node0,{address}"}
    env = detect_environment(environ, hostname="node0")
    assert env.hosts == ("node0", address)
    assert network_target(env) == address
    assert planned_network(env).ifname == name


def test_the_cli_shows_the_choice():
    env = detect_environment({"MASTER_ADDR": "127.0.0.1"}, hostname="n0")
    assert planned_network(env).describe() == "lo 127.0.0.1 (route to 127.0.0.1)"


def test_python_m_launcher_env_shows_the_choice():
    environ = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "USER")},
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "PYTHONPATH": str(REPO_ROOT)}
    shown = subprocess.run([sys.executable, "-m", "launcher.env", "--json"], env=environ,
                           capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(shown.stdout)["network"] == "lo 127.0.0.1 (route to 127.0.0.1)"
