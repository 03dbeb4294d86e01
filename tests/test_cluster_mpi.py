"""The compose MPI cluster for real: containers on a private network, mpiexec over ssh.

One 3-node cluster serves the module (2-node runs use node0 and node1 of it); each run is the
user's own command, ``invoke run --runtime docker``.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from benchmarks import cluster_scaling
from ddp_tasks import compose_spec as cs
from launcher.core.errors import LaunchError
from tests.fixtures.cluster import invoke_run, param_hashes, two_network_cluster_running
from tests.fixtures.mpi import json_objects

#: one epoch of digits; the global batch divides into 2 and 3 ranks
TRAIN = "--epochs 1 --global-batch-size 48 --log-every 5"


# --- the compose file (pure) ----------------------------------------------------------------

def test_committed_compose_file_is_the_generated_one():
    assert cs.MPI_COMPOSE.read_text() == cs.render(cs.mpi_compose(cs.DEFAULT_NODES),
                                                   cs.DEFAULT_NODES), \
        "docker/compose.yaml is stale: run `invoke cluster.compose --out docker/compose.yaml`"


@pytest.mark.parametrize("nodes", [1, 2, 5])
def test_compose_spec_shape(nodes):
    spec = yaml.safe_load(cs.render(cs.mpi_compose(nodes), nodes))
    hosts = [f"node{i}" for i in range(nodes)]
    assert list(spec["services"]) == ["keygen", *hosts]
    for host in hosts:
        service = spec["services"][host]
        assert service["hostname"] == host
        assert service["container_name"] == "${DDP_PREFIX:-}" + host
        # no interface: each rank takes the route to rank 0 (launcher.placement.network)
        assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(service["environment"])
        assert service["shm_size"] == "1g"
        assert service["ulimits"] == {"memlock": -1}
        assert "shared:/shared" in service["volumes"]
        assert "keys:/keys:ro" in service["volumes"]
        assert service["depends_on"]["keygen"] == {"condition": "service_completed_successfully"}
    # the launch node starts last, once every other node answers ssh
    assert spec["services"]["node0"]["depends_on"] == {
        "keygen": {"condition": "service_completed_successfully"},
        **{host: {"condition": "service_healthy"} for host in hosts[1:]},
    }


def test_zero_nodes_is_refused():
    with pytest.raises(LaunchError, match="at least 1") as caught:
        cs.mpi_compose(0)
    assert caught.value.hint


# --- the running cluster --------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.docker
def test_image_holds_no_keys(compose_mpi, cpu_image):
    """Keys come from the cluster's keygen at start-up, never from the image."""
    # the listing ends with a marker, so a container that did not run cannot pass as empty
    found = subprocess.run(
        ["docker", "run", "--rm", "--user", "root", "--entrypoint", "sh", cpu_image, "-c",
         'for f in /root/.ssh/* /home/*/.ssh/* /etc/ssh/ssh_host_*; do [ -e "$f" ] && '
         'echo "$f"; done; echo listed'],
        capture_output=True, text=True, timeout=120)
    assert (found.returncode, found.stdout) == (0, "listed\n"), found.stdout + found.stderr
    # while each node of the running cluster has this cluster's key and trusts its peers
    keys = {compose_mpi.check(host, "cat /root/.ssh/id_ed25519.pub") for host in
            compose_mpi.hosts}
    assert len(keys) == 1
    assert compose_mpi.check("node0", "ssh node2 hostname").strip() == "node2"


@pytest.mark.cluster
@pytest.mark.docker
@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_check_across_nodes(compose_mpi, nodes, backend):
    result = invoke_run(compose_mpi, nodes, "launcher.check", f"--backend {backend} --json")
    assert result.returncode == 0, result.stdout
    reports = [rank for obj in json_objects(result.stdout) for rank in obj.get("ranks", ())]
    hosts = {report["rank"]: report["host"] for report in reports}
    assert hosts == {rank: f"node{rank}" for rank in range(nodes)}, result.stdout


@pytest.mark.cluster
@pytest.mark.docker
@pytest.mark.parametrize("nodes", [2, 3])
def test_train_gives_one_model_on_every_node(compose_mpi, nodes):
    run_dir = f"/shared/runs/train-{nodes}"
    result = invoke_run(compose_mpi, nodes, "launcher.train", f"{TRAIN} --run-dir {run_dir}")
    assert result.returncode == 0, result.stdout
    hashes = param_hashes(result.stdout)
    assert sorted(hashes) == list(range(nodes)), result.stdout
    assert len(set(hashes.values())) == 1, hashes
    # --backend auto under Hydra's mpiexec with the image's MPICH: the compiled mpi backend,
    # which the image's build stage compiled against that MPICH
    assert "backend mpi_cxx, device cpu" in result.stdout, result.stdout
    # rank 0 wrote the final checkpoint where every node sees it
    for host in compose_mpi.hosts[:nodes]:
        assert "ckpt-" in compose_mpi.check(host, f"ls {run_dir}/checkpoints")


@pytest.mark.cluster
@pytest.mark.docker
def test_node_local_and_shared_data_give_the_same_model(compose_mpi):
    """Node-local data: each node prepares its own copy. Shared: one copy for all nodes."""
    hashes = {}
    for kind, data_dir in (("local", "/tmp/ddp-data"), ("shared", "/shared/data")):
        result = invoke_run(compose_mpi, 2, "launcher.train",
                            f"{TRAIN} --max-steps 5 --data-dir {data_dir} "
                            f"--run-dir /shared/runs/data-{kind}")
        assert result.returncode == 0, result.stdout
        found = param_hashes(result.stdout)
        assert sorted(found) == [0, 1], result.stdout
        hashes[kind] = found[0]
    for host in ("node0", "node1"):
        assert compose_mpi.check(host, "ls /tmp/ddp-data/cache").split(), host
    assert compose_mpi.exec("node2", "ls /tmp/ddp-data").returncode != 0, \
        "node2 took no part, it must have no data"
    assert hashes["local"] == hashes["shared"]


@pytest.mark.cluster
@pytest.mark.docker
def test_weak_scaling_benchmark_measures_each_backend_across_nodes(compose_mpi):
    result = cluster_scaling.weak_scaling(compose_mpi.prefix, list(compose_mpi.hosts[:2]),
                                          ["mpi", "gloo"], repeats=1, steps=20)
    assert [r["backend"] for r in result["rounds"]] == ["mpi", "gloo"]
    for r in result["rounds"]:
        assert r["rate_1"] > 0 and r["rate_n"] > 0 and r["rate_n_independent"] > 0
        assert r["efficiency"] == pytest.approx(r["rate_n"] / (2 * r["rate_1"]))
        assert r["efficiency"] == pytest.approx(r["machine_efficiency"] * r["sync_efficiency"])
    assert set(result["summary"]) == {"mpi", "gloo"}


@pytest.mark.cluster
@pytest.mark.docker
def test_two_networks_the_first_a_dead_end_train_without_a_flag(cpu_image):
    """Every node's eth0 is a network of its own, the shared one is eth1, node0's name is
    127.0.1.1 on node0, and the compose file names no interface. Before the route decided,
    MPICH's UCX tried eth0 and MPI_Init failed ("Destination is unreachable")."""
    with two_network_cluster_running(cpu_image, 2) as cluster:
        assert cluster.check("node0", "getent hosts node0").split()[0] == "127.0.1.1"
        result = invoke_run(cluster, 2, "launcher.check", "--backend gloo,mpi --json")
        assert result.returncode == 0, result.stdout
        ranks = [rank for obj in json_objects(result.stdout) for rank in obj.get("ranks", ())]
        assert [r["interface"].split()[0] for r in ranks] == ["eth1", "eth1"], result.stdout
        for backend in ("gloo", "mpi"):
            run = invoke_run(cluster, 2, "launcher.train",
                             f"{TRAIN} --max-steps 5 --backend {backend} "
                             f"--run-dir /shared/runs/two-{backend}")
            assert run.returncode == 0, run.stdout
            hashes = param_hashes(run.stdout)
            assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1, run.stdout
