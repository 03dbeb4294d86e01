"""Compose clusters on one Docker engine, for real: N MPI nodes reached over ssh, or Slurm with
2 nodes. The specs and command lines come from ``ddp_tasks.compose_spec`` (pure); this module
runs docker-compose, waits for health and holds the ``cluster.*`` tasks.

Secrets are never in an image: a one-shot ``keygen`` service writes the cluster's ssh keys (and
munge key) into a volume that ``down`` removes with everything else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from invoke import Collection, task

from ddp_tasks.compose_spec import (
    DEFAULT_IMAGE,
    DEFAULT_NODES,
    DEFAULT_PROCS_PER_NODE,
    DEFAULT_PROJECT,
    DEFAULT_SLURM_IMAGE,
    DOCKER_DIR,
    MPI_COMPOSE,
    RUNS_DIR,
    SLURM_COMPOSE,
    SLURM_DOCKERFILE,
    check_nodes,
    compose_argv,
    hosts,
    mpi_compose,
    render,
)
from ddp_tasks.task_errors import user_errors
from launcher.core.errors import LaunchError
from launcher.placement import shm

HEALTH_TIMEOUT = 120  # seconds for every node of a fresh cluster to answer ssh
COMPOSE_TIMEOUT = 300  # seconds for one docker-compose call


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
    check_nodes(nodes)
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
    with user_errors():
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
    with user_errors():
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
    with user_errors():
        project = project or ("ddp-slurm" if slurm else DEFAULT_PROJECT)
        generated = RUNS_DIR / project / "compose.yaml"
        compose_file = (SLURM_COMPOSE if slurm else
                        generated if generated.exists() else MPI_COMPOSE)
        left = remove(project, compose_file)
        if left:
            raise LaunchError(f"cluster {project!r} left behind: {', '.join(left)}",
                              hint="remove them with docker rm -f / docker network rm / "
                              "docker volume rm")
        print(f"cluster {project!r} removed")


ns = Collection("cluster", compose, up, down)
