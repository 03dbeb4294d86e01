"""Rendezvous address and port: picked by rank 0 and broadcast over the real MPI."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.group import rendezvous, store_client
from launcher.group.rendezvous import reachable_address, resolve_rendezvous
from launcher.placement.env import detect_environment
from launcher.placement.ports import ephemeral_range
from tests.fixtures.mpi import REPO_ROOT, clean_environ, json_objects, run_mpi

# Every rank resolves, then proves the result works: rank 0 listens on (addr, port) and every
# other rank connects to it and sends its rank.
SNIPPET = """
import json, socket
from mpi4py import MPI
from launcher.placement.env import detect_environment
from launcher.group.rendezvous import resolve_rendezvous

env = resolve_rendezvous(detect_environment())
comm = MPI.COMM_WORLD
received = []
if env.rank == 0:
    server = socket.create_server(("", env.master_port))
    comm.barrier()
    for _ in range(env.world_size - 1):
        conn, _ = server.accept()
        with conn:
            received.append(int(conn.recv(16).decode()))
    server.close()
else:
    comm.barrier()
    with socket.create_connection((env.master_addr, env.master_port), timeout=20) as conn:
        conn.sendall(str(env.rank).encode())
print(json.dumps({"rank": env.rank, "addr": env.master_addr, "port": env.master_port,
                  "hosts": env.hosts, "node_rank": env.node_rank, "num_nodes": env.num_nodes,
                  "received": sorted(received)}), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 3])
def test_rank0_picks_and_broadcasts(size):
    result = run_mpi(size, ["-c", SNIPPET], timeout=90)
    assert result.returncode == 0, result.output
    records = {r["rank"]: r for r in json_objects(result.stdout)}
    assert sorted(records) == list(range(size)), result.output
    assert len({(r["addr"], r["port"]) for r in records.values()}) == 1  # all agree
    assert records[0]["received"] == list(range(1, size))  # and it is reachable
    host = socket.gethostname()
    for record in records.values():
        assert 0 < record["port"] < 65536
        assert (record["hosts"], record["node_rank"], record["num_nodes"]) == ([host], 0, 1)


@pytest.mark.mpi
def test_explicit_master_is_kept_under_mpi():
    code = ("import json; from launcher.placement.env import detect_environment as d; "
            "from launcher.group.rendezvous import resolve_rendezvous as r; "
            "e = r(d()); print(json.dumps({'addr': e.master_addr, 'port': e.master_port}))")
    result = run_mpi(2, ["-c", code], timeout=60,
                     env={"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"})
    assert result.returncode == 0, result.output
    assert json_objects(result.stdout) == [{"addr": "10.1.2.3", "port": 29400}] * 2


STORE_FIRST = """
import json
from datetime import timedelta
from launcher.placement.env import detect_environment
from launcher.group.rendezvous import start_store

env, store = start_store(detect_environment(), "gloo", timedelta(seconds=60))
store.set(f"from/{env.rank}", str(env.rank))
seen = [store.get(f"from/{other}").decode() for other in range(env.world_size)]
print(json.dumps({"rank": env.rank, "port": env.master_port, "seen": seen,
                  "bound": getattr(store, "port", None)}), flush=True)
"""


@pytest.mark.mpi
def test_rank0_binds_the_store_before_it_tells_the_port():
    """No MASTER_PORT under mpiexec: rank 0's store takes a port the kernel picks as it binds,
    and that port is what every rank is told (no window in which another program takes it)."""
    result = run_mpi(3, ["-c", STORE_FIRST], timeout=90)
    assert result.returncode == 0, result.output
    records = {r["rank"]: r for r in json_objects(result.stdout)}
    assert sorted(records) == [0, 1, 2], result.output
    assert {r["port"] for r in records.values()} == {records[0]["bound"]}
    low, high = ephemeral_range()  # the kernel's pick, not one picked first (free_port)
    assert low <= records[0]["port"] <= high
    assert all(r["seen"] == ["0", "1", "2"] for r in records.values())


@pytest.mark.mpi
def test_a_given_port_in_the_ephemeral_range_is_warned_of_once():
    """Enroot's Slurm hook derives MASTER_PORT from the job id, often inside the range
    (PITFALLS): rank 0 says so before it binds; the job itself goes on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # the kernel's pick: inside the ephemeral range
        port = probe.getsockname()[1]
    result = run_mpi(2, ["-c", STORE_FIRST], timeout=90,
                     env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert result.returncode == 0, result.output
    assert {r["port"] for r in json_objects(result.stdout)} == {port}, result.output
    assert result.stderr.count(f"warning: MASTER_PORT={port} lies in this node's ephemeral "
                               "range") == 1, result.output


def test_single_process_gets_loopback_and_a_free_port():
    env = resolve_rendezvous(detect_environment({}, hostname="h"))
    assert env.master_addr == "127.0.0.1"
    with socket.create_server(("127.0.0.1", env.master_port)):
        pass  # it was free


def test_single_process_keeps_given_port():
    env = resolve_rendezvous(detect_environment({"MASTER_PORT": "29555"}, hostname="h"))
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29555)


def test_torchrun_and_slurm_are_left_alone():
    env = detect_environment({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                              "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}, hostname="h")
    assert resolve_rendezvous(env) is env


def test_no_mpi_and_no_address_is_an_error():
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, hostname="h")
    with pytest.raises(LaunchError) as info:
        resolve_rendezvous(env)
    assert "torchrun" in info.value.message and "MASTER_ADDR" in info.value.hint
    with pytest.raises(LaunchError):
        resolve_rendezvous(replace(env, master_addr="n1"))


def test_mpi_world_that_disagrees_with_the_launcher():
    """mpi4py on another MPI than the launcher's: every process is a world of one."""
    code = ("from launcher.placement.env import detect_environment as d; "
            "from launcher.group.rendezvous import resolve_rendezvous as r; r(d())")
    environ = clean_environ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2",
                             "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environ, cwd=REPO_ROOT, timeout=60)
    assert result.returncode != 0
    assert "launcher says rank 1 of 2 (mvapich) but MPI says rank 0 of 1" in result.stderr


@pytest.mark.parametrize(
    "name, resolved, expected",
    [("localhost", "127.0.0.1", "localhost"),      # loopback: the name, peers resolve it
     ("node0", "127.0.1.1", "node0"),              # Debian's /etc/hosts line for the host
     ("node0", "10.1.2.3", "10.1.2.3"),            # a routable name: its address
     ("no-such-host.invalid", None, "no-such-host.invalid")],
)
def test_reachable_address(monkeypatch, name, resolved, expected):
    monkeypatch.setattr(rendezvous, "resolve", {name: resolved}.get)
    assert reachable_address(name) == expected


def test_reachable_address_takes_what_peers_resolve_and_this_host_holds(monkeypatch):
    """Peers' view wins over this host's own resolution, but only for an address it holds
    (not loopback): the majority of such answers."""
    held = {"10.9.0.1": "eth1", "10.9.0.2": "eth2"}
    monkeypatch.setattr(rendezvous, "resolve", {"node0": "127.0.1.1"}.get)
    monkeypatch.setattr(rendezvous.network, "interface_of", held.get)
    seen = ["10.9.0.2", "192.0.2.9", "10.9.0.1", "10.9.0.2", None, "127.0.0.1"]
    assert reachable_address("node0", seen) == "10.9.0.2"
    assert reachable_address("node0", ["192.0.2.9", "127.0.0.1"]) == "node0"


@pytest.mark.parametrize(("answers", "joined"), [
    # rank 0's store answers late on a loaded node: torch's client times out, try again
    (["The client socket has timed out after 3000ms while trying to connect to (h, 1)."], True),
    # not a store: it answers with something else, or accepts and never replies
    (["Broken pipe"], False),
    ([None], False),
])
def test_only_a_late_store_is_tried_again(monkeypatch, answers, joined):
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, hostname="h")
    store = dist.HashStore()
    outcomes = [RuntimeError(a) if a else None for a in answers] + [store]
    monkeypatch.setattr(store_client.socket, "create_connection", lambda *a, **k: socket.socket())
    monkeypatch.setattr(store_client, "_attempt", lambda env: outcomes.pop(0))
    if joined:
        assert store_client.connect(env, timedelta(seconds=60)) is store
    else:
        with pytest.raises(LaunchError, match="answers, but not as rank 0's rendezvous store"):
            store_client.connect(env, timedelta(seconds=60))
        assert outcomes == [store]  # named at the first answer, no second try
