"""CPU binding: the plan on made-up NUMA layouts, what auto decides, the overlap warning of
launcher.check, and real mpiexec ranks bound to disjoint CPUs with torch's threads following,
or keeping the binding Hydra set."""

from __future__ import annotations

import os
import re

import pytest

from launcher.core.errors import LaunchError
from launcher.diagnostics.rank_report import cpu_overlaps, format_table
from launcher.placement.cpus import (
    BESIDE,
    KEPT,
    decide,
    format_cpulist,
    numa_nodes,
    parse_cpulist,
    plan,
)
from launcher.placement.gpu_numa import local_gpu_nodes, pci_address
from tests.fixtures.mpi import run_mpi
from tests.fixtures.training import train
from tests.test_check import _report

#: two sockets of four CPUs, numbered in blocks, and the same interleaved (as many BIOSes do)
BLOCKS = {0: frozenset(range(4)), 1: frozenset(range(4, 8))}
INTERLEAVED = {0: frozenset({0, 2, 4, 6}), 1: frozenset({1, 3, 5, 7})}
ALL = frozenset(range(8))


def test_cpulists_read_back():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpulist(set()) == "-"


@pytest.mark.parametrize("nodes", [BLOCKS, INTERLEAVED])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_cores_are_disjoint_even_and_in_as_few_numa_nodes_as_can_be(nodes, ranks):
    sets = [plan("cores", ALL, nodes, rank, ranks) for rank in range(ranks)]
    assert all(share == 1 for _, share in sets)
    cpus = [c for c, _ in sets]
    assert sorted(cpu for c in cpus for cpu in c) == sorted(ALL)  # disjoint, all used
    assert max(map(len, cpus)) - min(map(len, cpus)) <= 1
    if ranks in (2, 4, 8):  # a divisor of the node size: no set spans two NUMA nodes
        assert all(sum(bool(c & node) for node in nodes.values()) == 1 for c in cpus), cpus


def test_two_ranks_on_interleaved_numbering_get_one_socket_each():
    assert [plan("cores", ALL, INTERLEAVED, r, 2)[0] for r in (0, 1)] == [
        INTERLEAVED[0], INTERLEAVED[1]]


def test_numa_gives_whole_nodes_and_counts_who_shares_them():
    assert [plan("numa", ALL, BLOCKS, r, 4) for r in range(4)] == [
        (BLOCKS[0], 2), (BLOCKS[0], 2), (BLOCKS[1], 2), (BLOCKS[1], 2)]
    assert plan("numa", ALL, BLOCKS, 0, 1) == (ALL, 1)


def test_auto_binds_by_cores_keeps_a_launchers_mask_and_leaves_a_lone_rank_alone():
    bound = decide("auto", ALL, ALL, BLOCKS, 1, 2)
    assert (bound.cpus, bound.how, bound.threads) == (BLOCKS[1], "bound by --bind auto", 4)
    kept = decide("auto", frozenset({2, 3}), ALL, BLOCKS, 1, 2)
    assert (kept.cpus, kept.how, kept.threads) == ({2, 3}, KEPT, 2)
    assert decide("cores", frozenset({2, 3}), ALL, BLOCKS, 1, 2).how == KEPT
    alone = decide("auto", ALL, ALL, BLOCKS, 0, 1)
    assert (alone.cpus, alone.how, alone.threads) == (ALL, "unbound", 8)
    crowded = decide("auto", frozenset({0, 1}), None, BLOCKS, 2, 3)  # 3 ranks, 2 CPUs
    assert (crowded.how, crowded.threads) == ("unbound", 1)
    on_gpus = decide("auto", ALL, ALL, BLOCKS, 1, 2, gpus=())  # GPUs whose nodes are unknown
    assert (on_gpus.how, decide("cores", ALL, ALL, BLOCKS, 1, 2, gpus=()).cpus) == (
        "unbound", BLOCKS[1])
    unbound = decide("none", ALL, ALL, BLOCKS, 0, 2)
    assert (unbound.how, unbound.threads, unbound.numa) == ("unbound", 4, (0, 1))


#: a two-socket GPU host: CPUs 0-7 on node 0, 8-15 on node 1, two GPUs on each socket
GPUS = {"0000:1a:00.0": 0, "0000:3d:00.0": 0, "0000:9c:00.0": 1, "0000:c1:00.0": 1}
SOCKET = {0: frozenset(range(8)), 1: frozenset(range(8, 16))}
HOST = frozenset(range(16))


@pytest.fixture
def sysfs(tmp_path):
    """A fake /sys: the NUMA nodes' cpulists and each GPU's numa_node, by PCI address."""
    for node, cpus in SOCKET.items():
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(format_cpulist(cpus) + "\n")
    for address, node in {**GPUS, "0000:e3:00.0": -1}.items():
        (tmp_path / "pci" / address).mkdir(parents=True)
        (tmp_path / "pci" / address / "numa_node").write_text(f"{node}\n")
    return tmp_path


def _visible(cuda_visible_devices: str) -> list[str]:
    """The PCI addresses CUDA lists under CUDA_VISIBLE_DEVICES (PCI_BUS_ID order)."""
    return [sorted(GPUS)[int(index)] for index in cuda_visible_devices.split(",")]


def _bound(sysfs, addresses: list[str], mode: str = "auto", allowed=HOST) -> list[frozenset]:
    nodes = numa_nodes(sysfs / "node")
    assert nodes == SOCKET
    gpus = local_gpu_nodes(addresses, len(addresses), sysfs / "pci")
    found = [decide(mode, allowed, allowed, nodes, rank, len(addresses), gpus)
             for rank in range(len(addresses))]
    assert all(b.how == f"bound by --bind {mode} {BESIDE}" for b in found), found
    return [b.cpus for b in found]


def _span(first: int, last: int) -> frozenset[int]:
    return frozenset(range(first, last + 1))


@pytest.mark.parametrize("mode", ["auto", "numa"])
def test_ranks_are_bound_beside_their_gpus_splitting_each_socket(sysfs, mode):
    assert pci_address(0, 0xC1, 0) == "0000:c1:00.0"
    assert _bound(sysfs, _visible("0,1,2,3"), mode) == [
        _span(0, 3), _span(4, 7), _span(8, 11), _span(12, 15)]
    # CUDA_VISIBLE_DEVICES reorders the GPUs: the CPUs follow each rank's GPU, not its number
    assert _bound(sysfs, _visible("2,0,3,1"), mode) == [
        _span(8, 11), _span(0, 3), _span(12, 15), _span(4, 7)]
    # two ranks whose GPUs share socket 1: its CPUs split between them, socket 0 left alone
    assert _bound(sysfs, _visible("2,3"), mode) == [_span(8, 11), _span(12, 15)]
    # three ranks: socket 0's rank has it whole, socket 1's two share theirs unevenly
    assert _bound(sysfs, _visible("0,2,3"), mode) == [SOCKET[0], _span(8, 11), _span(12, 15)]
    assert _bound(sysfs, _visible("3"), mode) == [SOCKET[1]]  # one rank: its GPU's socket
    # a cgroup of 6 CPUs on each socket (and ranks on them alone): the allowed ones split
    six = _span(0, 5) | _span(8, 13)
    assert _bound(sysfs, _visible("0,1"), mode, allowed=six) == [_span(0, 2), _span(3, 5)]


def test_where_a_gpus_node_is_unknown_the_cpu_rule_holds(sysfs):
    nodes = numa_nodes(sysfs / "node")
    unknown = local_gpu_nodes([*_visible("0,1,2"), "0000:e3:00.0"], 4, sysfs / "pci")
    assert unknown == (0, 0, 1, None)
    assert local_gpu_nodes(["0000:ff:00.0"], 1, sysfs / "pci") == (None,)  # not in sysfs
    assert local_gpu_nodes(_visible("0"), 2, sysfs / "pci") == ()  # one GPU, two ranks
    for gpus in (unknown, (), (None,) * 4):
        assert decide("auto", HOST, HOST, nodes, 1, 4, gpus).how == "unbound"
        assert decide("numa", HOST, HOST, nodes, 1, 4, gpus).cpus == SOCKET[0]
        assert decide("cores", HOST, HOST, nodes, 1, 4, gpus).cpus == _span(4, 7)
    # the GPU's socket outside this rank's cgroup, or with fewer CPUs than ranks beside it
    on_one = local_gpu_nodes(_visible("2,3"), 2, sysfs / "pci")
    assert decide("auto", SOCKET[0], SOCKET[0], nodes, 0, 2, on_one).how == "unbound"
    assert decide("auto", _span(0, 8), None, nodes, 1, 2, on_one).how == "unbound"


def test_a_launchers_mask_is_kept_on_gpu_hosts_too(sysfs):
    gpus = local_gpu_nodes(_visible("0,1"), 2, sysfs / "pci")
    kept = decide("auto", frozenset({12}), HOST, numa_nodes(sysfs / "node"), 0, 2, gpus)
    assert (kept.cpus, kept.how) == ({12}, KEPT)


def test_cores_with_more_ranks_than_cpus_is_a_user_error():
    with pytest.raises(LaunchError, match="3 ranks on this node and 2 CPUs") as caught:
        decide("cores", frozenset({0, 1}), None, BLOCKS, 0, 3)
    assert caught.value.hint


def test_check_names_the_ranks_that_share_cpus():
    reports = [_report(0, cpus="0-3"), _report(1, cpus="2-5"), _report(2, cpus="6-7"),
               _report(3, host="other", cpus="0-3")]
    [line] = cpu_overlaps(reports)
    assert line.startswith("WARNING n0: ranks 0-1 share CPUs 2-3: ")
    assert cpu_overlaps(reports[2:]) == []


def test_check_shows_the_numa_node_of_each_ranks_gpu():
    reports = [_report(0, device="cuda:0", cpus="0-7", numa="0", gpu_numa="0"),
               _report(1, device="cuda:1", cpus="8-15", numa="1", gpu_numa="?")]
    header, *rows = format_table(reports).splitlines()[:3]
    column = header.split().index("gpu_numa")
    assert [row.split()[column] for row in rows] == ["0", "?"]


AFFINITY = re.compile(r"affinity rank=(\d) cpus=(\S+) threads=(\d+)")
FLAGS = ("--model", "tests.affinity_model:factory", "--epochs", "1", "--max-steps", "2")


def _affinities(result) -> dict[int, tuple[str, int]]:
    return {int(r): (cpus, int(threads)) for r, cpus, threads in AFFINITY.findall(result.stdout)}


@pytest.mark.mpi
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to bind 2 ranks")
def test_ranks_are_bound_to_their_own_cpus_and_threads_follow(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    bound = train(2, tmp_path / "a", tmp_path / "data", *FLAGS, "--bind", "cores")
    assert bound.returncode == 0, bound.output
    found = _affinities(bound)
    assert set(found) == {0, 1}, bound.output
    sets = [parse_cpulist(found[r][0]) for r in (0, 1)]
    assert not sets[0] & sets[1] and sets[0] | sets[1] == set(mine), found
    assert all(threads == len(s) for (_, threads), s in zip(found.values(), sets, strict=True))
    assert "cores: bound by --bind cores (rank 0: CPUs " in bound.stdout

    loose = train(2, tmp_path / "b", tmp_path / "data", *FLAGS, "--bind", "none")
    assert loose.returncode == 0, loose.output
    assert {cpus for cpus, _ in _affinities(loose).values()} == {format_cpulist(mine)}
    assert "cores:" not in loose.stdout


@pytest.mark.mpi
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to bind 2 ranks")
def test_a_binding_the_launcher_set_is_kept(tmp_path):
    args = ["-m", "launcher.train", "--run-dir", str(tmp_path / "run"), "--data-dir",
            str(tmp_path / "data"), "--backend", "gloo", *FLAGS]
    result = run_mpi(2, args, timeout=240, mpiexec_args=("-bind-to", "core"))
    assert result.returncode == 0, result.output
    assert "cores: kept the launcher's binding (rank 0: CPUs " in result.stdout, result.output
    found = _affinities(result)
    assert all(len(parse_cpulist(cpus)) == 1 and threads == 1
               for cpus, threads in found.values()), found
