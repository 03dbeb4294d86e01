"""Compose clusters on one Docker engine: N MPI nodes reached over ssh, or Slurm with 2 nodes.

Compose v1 has no loops, so the MPI cluster's compose file comes from ``mpi_compose`` (pure) for
any node count; docker/compose.yaml is its output for the default 3 nodes, committed so that a
plain ``docker-compose -p ddp -f docker/compose.yaml up -d`` works too (a test keeps the two
equal). The Slurm cluster (docker/compose.slurm.yaml) has a fixed shape and is written by hand.

Secrets are never in an image: a one-shot ``keygen`` service writes the cluster's ssh keys (and
munge key) into a volume that ``down`` removes with everything else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from invoke import Collection, task

from launcher import shm
from launcher.errors import LaunchError

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
MPI_COMPOSE = DOCKER_DIR / "compose.yaml"
SLURM_COMPOSE = DOCKER_DIR / "compose.slurm.yaml"
SLURM_DOCKERFILE = DOCKER_DIR / "slurm.Dockerfile"
#: generated compose files of clusters with a node count other than the committed one
RUNS_DIR = ROOT / "runs" / "cluster"

DEFAULT_NODES = 3
DEFAULT_PROJECT = "ddp"
DEFAULT_IMAGE = "ddp:cpu"
DEFAULT_SLURM_IMAGE = "ddp-slurm:cpu"
#: compose reads the image from the environment, so one file serves every tag
IMAGE_REF = "${DDP_IMAGE:-" + DEFAULT_IMAGE + "}"
#: container names are the host names (``docker exec node0``) unless clusters share an engine,
#: as tests do: then DDP_PREFIX makes them unique
PREFIX_REF = "${DDP_PREFIX:-}"
#: ranks per node the committed compose file is sized for (/dev/shm: launcher.shm)
DEFAULT_PROCS_PER_NODE = 4
SHARED_DIR = "/shared"
CLUSTER_SCRIPTS = "/opt/ddp/cluster"
HEALTH_TIMEOUT = 120  # seconds for every node of a fresh cluster to answer ssh
COMPOSE_TIMEOUT = 300  # seconds for one docker-compose call

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


def _check_nodes(nodes: int) -> None:
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
        # no interface here: every rank takes the one that routes to rank 0 (launcher.network)
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
            "interval": "1s",
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
    _check_nodes(nodes)
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


# ------------------------------------------------------------------------------ compose calls

def compose_argv(project: str, compose_file: Path, *args: str) -> list[str]:
    """``docker-compose`` for one project; relative paths in the file resolve from docker/."""
    return ["docker-compose", "--project-name", project, "--project-directory", str(DOCKER_DIR),
            "--file", str(compose_file), *args]


def _run(argv: list[str], timeout: int = COMPOSE_TIMEOUT, env: dict | None = None,
         quiet: bool = False) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, timeout=timeout, text=True, env=env,
                                capture_output=quiet)
    except FileNotFoundError as error:
        raise LaunchError(f"{argv[0]} is not installed",
                          hint="apt-get install -y docker.io docker-compose") from error
    except subprocess.TimeoutExpired as error:
        raise LaunchError(f"`{' '.join(argv[:6])} ...` took more than {timeout} s",
                          hint="see `docker ps -a` and `docker logs`; then invoke cluster.down"
                          ) from error
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise LaunchError(f"`{' '.join(argv)}` failed ({result.returncode}) {' '.join(detail)}",
                          hint="read the compose output above; `invoke cluster.down` cleans up")
    return result


def compose_env(prefix: str = "", **images: str) -> dict[str, str]:
    """The variables the compose files read: DDP_IMAGE / DDP_SLURM_IMAGE and DDP_PREFIX."""
    return {**os.environ, **images, "DDP_PREFIX": prefix}


def health(container: str) -> str:
    """``healthy``, ``starting``, ``unhealthy``, ``exited`` ... or ``missing``."""
    result = subprocess.run(
        ["docker", "inspect", "--format",
         "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}",
         container], capture_output=True, text=True, timeout=30)
    return result.stdout.strip() if result.returncode == 0 else "missing"


def wait_healthy(containers: list[str], timeout: float = HEALTH_TIMEOUT) -> float:
    """Block until every container is healthy; the seconds it took, or a LaunchError."""
    start = time.monotonic()
    while True:
        states = {name: health(name) for name in containers}
        if all(state == "healthy" for state in states.values()):
            return time.monotonic() - start
        bad = {n: s for n, s in states.items() if s in ("unhealthy", "exited", "dead", "missing")}
        if bad or time.monotonic() - start > timeout:
            late = bad or {n: s for n, s in states.items() if s != "healthy"}
            raise LaunchError(
                "cluster nodes not healthy: "
                + ", ".join(f"{n} is {s}" for n, s in sorted(late.items())),
                hint=f"`docker logs {sorted(late)[0]}` tells why; then invoke cluster.down")
        time.sleep(0.5)


def leftovers(project: str) -> list[str]:
    """Containers, networks and volumes the project still has (empty after a clean ``down``)."""
    label = f"label=com.docker.compose.project={project}"
    found = []
    for kind, argv in (("container", ["docker", "ps", "-a", "--filter", label, "--format",
                                      "{{.Names}}"]),
                       ("network", ["docker", "network", "ls", "--filter", label, "--format",
                                    "{{.Name}}"]),
                       ("volume", ["docker", "volume", "ls", "--filter", label, "--format",
                                   "{{.Name}}"])):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
        found += [f"{kind} {name}" for name in out.split()]
    return found


# --------------------------------------------------------------------------------- clusters

def mpi_compose_file(nodes: int, project: str,
                     procs_per_node: int = DEFAULT_PROCS_PER_NODE, memlock: bool = True) -> Path:
    """The committed file for the default shape, else one generated under runs/cluster/."""
    if (nodes, procs_per_node, memlock) == (DEFAULT_NODES, DEFAULT_PROCS_PER_NODE, True):
        return MPI_COMPOSE
    path = RUNS_DIR / project / "compose.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(mpi_compose(nodes, procs_per_node=procs_per_node, memlock=memlock),
                           nodes))
    return path


def engine_grants_memlock(image: str) -> bool:
    """Whether the Docker engine can start a container with unlimited locked memory: not
    without CAP_SYS_RESOURCE ("error setting rlimit type 8: operation not permitted")."""
    probe = subprocess.run(["docker", "run", "--rm", "--ulimit", "memlock=-1", "--entrypoint",
                            "true", image], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 and "rlimit" not in probe.stderr:
        raise LaunchError(f"docker run {image} failed: {probe.stderr.strip()[-300:]}",
                          hint="build the image first: invoke build")
    return probe.returncode == 0


def up_mpi(nodes: int = DEFAULT_NODES, project: str = DEFAULT_PROJECT, prefix: str = "",
           image: str = DEFAULT_IMAGE, timeout: float = HEALTH_TIMEOUT,
           procs_per_node: int = DEFAULT_PROCS_PER_NODE, memlock: bool | None = None) -> float:
    """Start an MPI cluster and wait until every node answers ssh; the seconds that took.
    ``memlock`` None: unlimited locked memory where the engine grants it."""
    _check_nodes(nodes)
    if memlock is None:
        memlock = engine_grants_memlock(image)
    if not memlock:
        print("note: this Docker engine cannot lift the memlock limit (no CAP_SYS_RESOURCE: "
              "rootless, or a restricted VM); the nodes keep its limit", file=sys.stderr)
    return start_mpi(mpi_compose_file(nodes, project, procs_per_node, memlock), nodes, project,
                     prefix, image, timeout)


def start_mpi(compose_file: Path, nodes: int, project: str, prefix: str, image: str,
              timeout: float = HEALTH_TIMEOUT) -> float:
    """``up`` an MPI cluster's compose file; wait for its nodes; the seconds that took."""
    start = time.monotonic()
    _run(compose_argv(project, compose_file, "up", "--detach", "--no-build"),
         env=compose_env(prefix, DDP_IMAGE=image))
    wait_healthy([prefix + host for host in hosts(nodes)], timeout)
    return time.monotonic() - start


def up_slurm(project: str = "ddp-slurm", prefix: str = "", image: str = DEFAULT_SLURM_IMAGE,
             timeout: float = HEALTH_TIMEOUT) -> float:
    """Start slurmctld and 2 slurmd nodes and wait until Slurm reports them; seconds taken."""
    start = time.monotonic()
    _run(compose_argv(project, SLURM_COMPOSE, "up", "--detach", "--no-build"),
         env=compose_env(prefix, DDP_SLURM_IMAGE=image))
    wait_healthy([prefix + name for name in ("slurmctld", "node0", "node1")], timeout)
    return time.monotonic() - start


def remove(project: str, compose_file: Path) -> list[str]:
    """Remove the project's containers, network and volumes; what could not be removed."""
    _run(compose_argv(project, compose_file, "down", "--volumes", "--remove-orphans",
                      "--timeout", "5"), env=compose_env(), quiet=True)
    return leftovers(project)


def build_slurm_image(base: str = DEFAULT_IMAGE, tag: str = DEFAULT_SLURM_IMAGE,
                      timeout: int = 1800) -> str:
    """``docker build`` of docker/slurm.Dockerfile on top of the project image BASE."""
    _run(["docker", "build", "--file", str(SLURM_DOCKERFILE), "--build-arg", f"BASE_IMAGE={base}",
          "--tag", tag, str(DOCKER_DIR)], timeout=timeout)
    return tag


# ------------------------------------------------------------------------------------ tasks

PROCS_HELP = (f"the most ranks a node will run (default {DEFAULT_PROCS_PER_NODE}): /dev/shm is "
              f"{shm.SHM_PER_RANK // shm.MIB} MiB per rank, at least "
              f"{shm.SHM_FLOOR // shm.MIB} MiB")


@task(help={"nodes": f"node count (default {DEFAULT_NODES})", "procs_per_node": PROCS_HELP,
            "out": "where to write it (default: print it)"})
def compose(c, nodes=DEFAULT_NODES, procs_per_node=DEFAULT_PROCS_PER_NODE, out=""):
    """Print (or write) the compose file of an N-node MPI cluster."""
    text = render(mpi_compose(nodes, procs_per_node=procs_per_node), nodes)
    if out:
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)


@task(help={"nodes": f"MPI nodes node0..node{{N-1}} (default {DEFAULT_NODES})",
            "image": f"project image for the nodes (default {DEFAULT_IMAGE})",
            "project": f"compose project name (default {DEFAULT_PROJECT})",
            "prefix": "prefix of the container names (default none: node0, node1 ...)",
            "procs_per_node": PROCS_HELP,
            "slurm": "start the Slurm cluster (slurmctld, node0, node1) instead",
            "build": "with --slurm: (re)build the Slurm image from --image first"})
def up(c, nodes=DEFAULT_NODES, image="", project="", prefix="", slurm=False, build=False,
       procs_per_node=DEFAULT_PROCS_PER_NODE):
    """Start a compose cluster and wait until all its nodes are healthy."""
    if slurm:
        project = project or "ddp-slurm"
        if build:
            build_slurm_image(base=image or DEFAULT_IMAGE)
        seconds = up_slurm(project, prefix, DEFAULT_SLURM_IMAGE, HEALTH_TIMEOUT)
        print(f"Slurm cluster {project!r} healthy in {seconds:.1f} s. Try:\n"
              f"  docker exec {prefix}slurmctld srun -N 2 --ntasks-per-node=2 --mpi=pmi2 "
              "python -m launcher.check")
        return
    project = project or DEFAULT_PROJECT
    seconds = up_mpi(nodes, project, prefix, image or DEFAULT_IMAGE, HEALTH_TIMEOUT,
                     procs_per_node)
    print(f"MPI cluster {project!r}: {nodes} nodes healthy in {seconds:.1f} s. Try:\n"
          f"  invoke run --runtime docker --nodes {nodes} --module launcher.check")


@task(help={"project": f"compose project name (default {DEFAULT_PROJECT}, ddp-slurm with "
                       "--slurm)",
            "slurm": "tear down the Slurm cluster"})
def down(c, project="", slurm=False):
    """Remove a cluster's containers, network and volumes (its keys and shared data too)."""
    project = project or ("ddp-slurm" if slurm else DEFAULT_PROJECT)
    generated = RUNS_DIR / project / "compose.yaml"
    compose_file = SLURM_COMPOSE if slurm else (generated if generated.exists() else MPI_COMPOSE)
    left = remove(project, compose_file)
    if left:
        raise LaunchError(f"cluster {project!r} left behind: {', '.join(left)}",
                          hint="remove them with docker rm -f / docker network rm / "
                          "docker volume rm")
    print(f"cluster {project!r} removed")


ns = Collection("cluster", compose, up, down)
