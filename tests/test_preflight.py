"""``python -m launcher.check --preflight``: the naming rule on figures, and a slowed node for real.

For real, twice: 3 ranks as 3 nodes (torchrun's variables with GROUP_RANK, node names from
DDP_HOSTS), one of them held to a tenth of a CPU (a cgroup quota); and 3 containers on a Docker
network, one with its CPU quota cut to 0.1 (``docker run --cpus 0.1``). Both under a parent
cgroup that outweighs the rest of the machine (``tests.fixtures.cpu_groups``). The slowed node
must be the one named, in the file rank 0 writes. (Stopping a rank 9 ms in every 10 with
SIGSTOP did not slow it enough while a test beside held such a parent group: the stopping
thread, outside it, woke too late.)
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter

import pytest

from launcher.diagnostics.preflight import MAX_ROUNDS, NodeRow, link_rounds, slow_nodes
from launcher.placement.ports import free_port
from tests.fixtures.cpu_groups import join, outweighing_group
from tests.fixtures.mpi import REPO_ROOT, clean_environ


def _row(node: str, gflops: float, memory: float = 10.0, link: float | None = None) -> NodeRow:
    return NodeRow(node, 1, gflops, memory, link)


@pytest.mark.parametrize(("rows", "expected"), [
    # one node at a fifth of the others' GEMM: named, with the figure
    ([_row("n0", 100), _row("n1", 100), _row("n2", 20)], {"n2"}),
    # healthy spread (here 30 %) names nobody
    ([_row("n0", 100), _row("n1", 80), _row("n2", 70)], set()),
    # two nodes: the median is their mean; the slow one is under half of it
    ([_row("n0", 100), _row("n1", 20)], {"n1"}),
    # memory alone
    ([_row("n0", 100, 10), _row("n1", 100, 10), _row("n2", 100, 2)], {"n2"}),
    # a node whose links are slow, from 3 nodes on
    ([_row("n0", 100, link=10), _row("n1", 100, link=10), _row("n2", 100, link=1)], {"n2"}),
    # with 2 nodes one slow link cannot be pinned on either end
    ([_row("n0", 100, link=1), _row("n1", 100, link=10)], set()),
    # one node: nothing to compare with
    ([_row("n0", 1)], set()),
])
def test_naming_rule(rows, expected):
    slow = slow_nodes(rows)
    assert set(slow) == expected
    for reason in slow.values():
        assert "0.5x median" in reason


@pytest.mark.parametrize("count", [*range(1, 12), 100, 999, 1000, 100_000])
def test_link_rounds_are_few_disjoint_and_reach_every_node(count):
    """At most MAX_ROUNDS rounds whatever the size; within a round no node measures twice;
    every node has the ring's two links from 3 nodes on (one with 2), none a pair twice."""
    rounds = link_rounds(count)
    assert len(rounds) <= MAX_ROUNDS
    links = Counter()
    for pairs in rounds:
        nodes = [node for pair in pairs for node in pair]
        assert len(nodes) == len(set(nodes))
        links.update(nodes)
    assert sum(len(pairs) for pairs in rounds) == len({p for r in rounds for p in r})
    assert all(links[node] >= min(2, count - 1) for node in range(count))
    assert all(links[node] <= 3 for node in range(count))
    ring = {tuple(sorted((i, (i + 1) % count))) for i in range(count) if count > 1}
    assert ring <= {pair for pairs in rounds for pair in pairs}
    assert link_rounds(count) == rounds  # every rank draws the same shuffle


def test_a_slowed_node_is_named(tmp_path):
    port, world, slow = free_port(), 3, 2
    out = tmp_path / "slow-nodes"
    with outweighing_group(f"ddp-preflight-{tmp_path.name}") as nodes, \
            contextlib.ExitStack() as stack:
        ranks = []
        for rank in range(world):
            ranks.append(process := subprocess.Popen(
                [sys.executable, "-m", "launcher.check", "--preflight", "--slow-nodes", str(out),
                 "--backend", "gloo", "--timeout", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                env=clean_environ({
                    "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "DDP_HOSTS": "n0,n1,n2", "OMP_NUM_THREADS": "1",
                })))
            stack.callback(process.kill)
            join(nodes / f"n{rank}", process.pid, cpus=0.1 if rank == slow else None)
        outputs = [process.communicate(timeout=240) for process in ranks]
    for process, (_, stderr) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, stderr
    table = outputs[0][0]
    assert "GEMM GFLOP/s" in table and "n2 " in table, table
    assert out.read_text() == "n2\n", table


@pytest.mark.parametrize("args", [["--slow-nodes", "x"], ["--preflight", "--backend", "gloo,mpi"]])
def test_preflight_flags_misused_are_a_user_error(args):
    result = subprocess.run([sys.executable, "-m", "launcher.check", *args], capture_output=True,
                            text=True, cwd=REPO_ROOT, env=clean_environ(), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: --preflight measures over one backend" in result.stderr
    assert "HINT: python -m launcher.check --preflight" in result.stderr


@pytest.mark.docker
def test_a_container_with_its_cpu_quota_cut_is_named(tmp_path, dockerd, request):
    """The image's code is replaced by this tree's (a bind mount): no rebuild for a change.
    The containers share a parent group that outweighs the rest of the machine
    (tests.fixtures.cpu_groups): else, with the machine busy, the healthy ones are as slow."""
    image = "ddp:cpu"
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
        image = request.getfixturevalue("cpu_image")
    tmp_path.chmod(0o777)  # the image runs as an unprivileged user
    network = f"ddp-preflight-{tmp_path.name}"[:60]
    names = [f"{network}-node{i}" for i in range(3)]
    with outweighing_group(network) as parent, contextlib.ExitStack() as cleanup:
        subprocess.run(["docker", "network", "create", network], check=True,
                       capture_output=True)
        cleanup.callback(_remove, network, names)
        for i, name in enumerate(names):
            quota = ["--cpus", "0.1"] if i == 2 else []
            subprocess.run(
                ["docker", "run", "-d", *quota, "--cgroup-parent", f"/{parent.name}",
                 "--name", name, "--hostname", f"node{i}",
                 "--network", network, "-v", f"{REPO_ROOT / 'launcher'}:/opt/ddp/src/launcher:ro",
                 "-v", f"{tmp_path}:/out", *[f"-e{k}={v}" for k, v in {
                     "RANK": i, "WORLD_SIZE": 3, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1,
                     "GROUP_RANK": i, "MASTER_ADDR": "node0", "MASTER_PORT": 29555,
                     "OMP_NUM_THREADS": 1}.items()],
                 "--entrypoint", "python", image, "-m", "launcher.check", "--preflight",
                 "--backend", "gloo", "--slow-nodes", "/out/slow-nodes"],
                check=True, capture_output=True)
        statuses = [subprocess.run(["docker", "wait", name], capture_output=True, text=True,
                                   timeout=300).stdout.strip() for name in names]
        table = subprocess.run(["docker", "logs", names[0]], capture_output=True,
                               text=True).stdout
        assert statuses == ["0", "0", "0"], table
        assert (tmp_path / "slow-nodes").read_text() == "node2\n", table


def _remove(network: str, containers: list[str]) -> None:
    for name in containers:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    subprocess.run(["docker", "network", "rm", network], capture_output=True)
