"""The compose clusters as data: the MPI cluster's compose spec for any node count, its text,
the ``docker-compose`` command line, and the names both sides agree on. Pure: nothing here
starts a process or reads the environment (ddp_tasks/cluster.py does, with these).

Compose v1 has no loops, so the MPI cluster's compose file comes from ``mpi_compose`` for any
node count; docker/compose.yaml is its output for the default 3 nodes, committed so that a
plain ``docker-compose -p ddp -f docker/compose.yaml up -d`` works too (a test keeps the two
equal). The Slurm cluster (docker/compose.slurm.yaml) has a fixed shape and is written by hand.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ddp_tasks import flavors
from ddp_tasks import image_commands as ic
from launcher.core.errors import LaunchError
from launcher.placement import shm

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
MPI_COMPOSE = DOCKER_DIR / "compose.yaml"
SLURM_COMPOSE = DOCKER_DIR / "compose.slurm.yaml"
SLURM_DOCKERFILE = DOCKER_DIR / "slurm.Dockerfile"
#: generated compose files of clusters with a node count other than the committed one
RUNS_DIR = ROOT / "runs" / "cluster"

DEFAULT_NODES = 3
DEFAULT_PROJECT = "ddp"
DEFAULT_IMAGE = ic.image_tag(ic.DEFAULT_NAME, flavors.DEFAULT)
DEFAULT_SLURM_IMAGE = ic.image_tag(f"{ic.DEFAULT_NAME}-slurm", flavors.DEFAULT)
#: compose reads the image from the environment, so one file serves every tag
IMAGE_REF = "${DDP_IMAGE:-" + DEFAULT_IMAGE + "}"
#: container names are the host names (``docker exec node0``) unless clusters share an engine,
#: as tests do: then DDP_PREFIX makes them unique
PREFIX_REF = "${DDP_PREFIX:-}"
#: ranks per node the committed compose file is sized for (/dev/shm: launcher.placement.shm)
DEFAULT_PROCS_PER_NODE = 4
SHARED_DIR = "/shared"
#: how often Docker probes a node's health, for the node's whole life (Docker 20.10 has no
#: faster probing while it starts). A probe is an exec through dockerd, containerd and runc:
#: every second, the probes' own processes took 2.4 % of a cold CI run's CPU (2026-11-29,
#: ~0.02 CPU-s each), dockerd's part not counted
PROBE_INTERVAL = "3s"
CLUSTER_SCRIPTS = "/opt/ddp/cluster"

_HEADER = """\
# Written by `invoke cluster.compose --nodes {nodes}` (ddp_tasks/cluster.py): edit that, not this.
# {nodes} MPI nodes node0..node{last} on a private network, sshd with keys made per cluster by the
# keygen service, the shared volume at {shared}. Start: invoke cluster.up --nodes {nodes}
"""


def hosts(nodes: int) -> list[str]:
    """Host names of the MPI cluster's nodes: node0 .. node{N-1}."""
    return [f"node{i}" for i in range(nodes)]


def mpiexec_one_per_node(hosts: list[str]) -> list[str]:
    """Hydra's mpiexec, run on the first node, starting one rank on each of HOSTS over ssh.
    gloo's rendezvous address is the first node too: its default (loopback) serves one machine.
    """
    return ["mpiexec", "-launcher", "ssh", "-hosts", ",".join(hosts), "-n", str(len(hosts)),
            "-ppn", "1", "-genv", "MASTER_ADDR", hosts[0]]


def check_nodes(nodes: int) -> None:
    if nodes < 1:
        raise LaunchError(f"--nodes {nodes} must be at least 1", hint="pass --nodes 2 or more")


def _node_service(host: str, all_hosts: list[str], image: str, scripts: str,
                  procs_per_node: int, memlock: bool) -> dict:
    depends = {"keygen": {"condition": "service_completed_successfully"}}
    if host == all_hosts[0]:
        # mpiexec starts on the first node: it comes up only once every other node answers ssh
        depends.update({other: {"condition": "service_healthy"} for other in all_hosts[1:]})
    return {
        "image": image,
        "hostname": host,
        "container_name": PREFIX_REF + host,
        # sshd needs root; the image's default user would not do
        "user": "root",
        # sshd would not reap the orphans of dropped sessions: docker's init does
        "init": True,
        "entrypoint": [f"{CLUSTER_SCRIPTS}/node.sh"],
        # Docker's 64 MiB /dev/shm and its memlock limit are too small for MPI, NCCL and RDMA
        "shm_size": shm.docker_size(shm.recommended_shm(procs_per_node)),
        **({"ulimits": {"memlock": -1}} if memlock else {}),
        # no interface here: every rank takes the one that routes to rank 0
        # (launcher.placement.network)
        "environment": {
            "DDP_CLUSTER_HOSTS": ",".join(all_hosts),
            "DDP_SHARED_DIR": SHARED_DIR,
            # mpiexec's ssh: ends mpiexec when a node is cut off (see ssh-launch.sh)
            "HYDRA_LAUNCHER_EXEC": f"{CLUSTER_SCRIPTS}/ssh-launch.sh",
        },
        "volumes": ["keys:/keys:ro", f"shared:{SHARED_DIR}", f"{scripts}:{CLUSTER_SCRIPTS}:ro"],
        "networks": ["cluster"],
        "healthcheck": {
            "test": ["CMD", f"{CLUSTER_SCRIPTS}/healthcheck.sh"],
            "interval": PROBE_INTERVAL,
            "timeout": "5s",
            "retries": 30,
            "start_period": "1s",
        },
        "depends_on": depends,
    }


def mpi_compose(nodes: int = DEFAULT_NODES, image: str = IMAGE_REF,
                scripts: str = "./cluster", procs_per_node: int = DEFAULT_PROCS_PER_NODE,
                memlock: bool = True) -> dict:
    """The compose spec of an N-node MPI cluster for up to ``procs_per_node`` ranks per node
    (``scripts``: docker/cluster as seen from the compose file's project directory);
    ``memlock``: unlimited locked memory, which an engine without CAP_SYS_RESOURCE (rootless,
    some VMs) cannot grant."""
    check_nodes(nodes)
    if procs_per_node < 1:
        raise LaunchError(f"--procs-per-node {procs_per_node} must be at least 1",
                          hint="pass the most ranks a node will run, e.g. --procs-per-node 4")
    all_hosts = hosts(nodes)
    services = {
        "keygen": {
            "image": image,
            "user": "root",
            "entrypoint": [f"{CLUSTER_SCRIPTS}/keygen.sh"],
            "command": ["ssh"],
            "volumes": ["keys:/keys", f"{scripts}:{CLUSTER_SCRIPTS}:ro"],
            "network_mode": "none",
        },
    }
    for host in all_hosts:
        services[host] = _node_service(host, all_hosts, image, scripts, procs_per_node,
                                       memlock)
    return {
        "services": services,
        "networks": {"cluster": {"driver": "bridge"}},
        "volumes": {"keys": {}, "shared": {}},
    }


def render(spec: dict, nodes: int) -> str:
    """The compose file's text: a header that says where it comes from, then the spec."""
    header = _HEADER.format(nodes=nodes, last=nodes - 1, shared=SHARED_DIR)
    return header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False, width=100)


def compose_argv(project: str, compose_file: Path, *args: str) -> list[str]:
    """``docker-compose`` for one project; relative paths in the file resolve from docker/."""
    return ["docker-compose", "--project-name", project, "--project-directory", str(DOCKER_DIR),
            "--file", str(compose_file), *args]
