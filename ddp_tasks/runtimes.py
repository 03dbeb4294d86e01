"""Container runtimes on the host side: one small class per runtime, with a fixed interface.

Each knows what a launch needs from it: the prefix that runs a rank's program in the image
(``exec_prefix``), how the program's variables reach the rank (``launcher_env``: the names the
host launcher must set; ``exec_prefix`` may carry them instead), its bind syntax, its GPU flag,
and its own rules (``validate``). ``srun_options`` is for the one runtime that is an srun plugin
(Pyxis); ``outer`` and ``prepare`` for the one that runs the host launcher itself in a
container (Docker). ``RUNTIMES`` lists the classes by name; ``ddp_tasks.commands`` only asks
these methods. Host launchers (mpiexec, mpirun, srun) have the same shape: host_launchers.py.

What crosses into the container, per runtime (docs/launching.md, "Runtimes"):

- apptainer: host variables, but the image's %environment wins over them; a variable named
  APPTAINERENV_X becomes X whatever the image sets (and survives --cleanenv).
- charliecloud: host variables pass through; the image's ENV applies only with ``--set-env``,
  and ``--set-env=NAME=VALUE`` after it sets ours on top. A bind target must exist in the
  image (the image has /opt/host-mpi/lib, /opt/host-mpi/libfabric and /scratch).
- pyxis: host variables, but values the image sets win unless named in ``--container-env``.
- podman-hpc: only what ``-e`` names; ``--mpi`` and ``--gpu`` are its site modules.
- docker: mpiexec runs inside the compose cluster's first container (not per rank).
- none: python on the host.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ddp_tasks.compose_spec import hosts as cluster_hosts
from launcher.core.errors import LaunchError
from launcher.placement import shm

if TYPE_CHECKING:
    from ddp_tasks.launch_spec import Launch

Env = list[tuple[str, str]]


class ShellText(str):
    """A word that ``commands.render`` writes as it is, not quoted, for the shell that runs the
    line (the batch script's, or ``invoke run``'s) to expand: its variables are known only when
    the command runs. What is not to be expanded in it must be quoted already."""


class Runtime:
    """``none``: the program runs on the host, its variables set by the launcher."""

    name = "none"
    default_image = ""

    def prepare(self, launch: Launch) -> Launch:
        """The launch with what this runtime fills in itself (before it is validated)."""
        return launch

    def validate(self, launch: Launch) -> None:
        """Raise LaunchError for what this runtime cannot do, naming the flag to change."""
        if launch.binds and not self.binds:
            able = ", ".join(name for name, cls in RUNTIMES.items() if cls().binds)
            raise LaunchError(
                f"--bind needs a container runtime that binds ({able}), not {launch.runtime}",
                hint="drop --bind, or pass --runtime with one",
            )

    def outer(self, launch: Launch) -> list[str]:
        """What the host launcher itself runs in: nothing but the host, except for Docker."""
        return []

    def launcher_env(self, env: Env) -> Env:
        return list(env)

    def exec_prefix(self, launch: Launch) -> list[str]:
        return []

    def srun_options(self, launch: Launch) -> list[str]:
        return []

    def bind_args(self, bind: str) -> list[str]:
        return []

    def gpu_args(self) -> list[str]:
        return []

    def options(self, launch: Launch) -> list[str]:
        """The GPU flag when GPUs are asked for, then every bind, in this runtime's syntax."""
        argv = self.gpu_args() if launch.gpus_per_node else []
        for bind in launch.binds:
            argv += self.bind_args(bind)
        return argv

    @property
    def binds(self) -> bool:
        """Whether ``--bind`` means anything here: the runtime has a bind syntax of its own."""
        return type(self).bind_args is not Runtime.bind_args


class Apptainer(Runtime):
    name, default_image = "apptainer", "ddp-cpu.sif"
    ENV_PREFIX = "APPTAINERENV_"

    #: Apptainer 1.3+ (``--sharens``): the first rank of a node starts the container, the
    #: others join it, so the node's ranks share one user namespace and MPI's single-copy
    #: transfers work between them (launcher/mpi/cma.py). Older versions ignore the variable.
    SHARE_NAMESPACES = ("APPTAINER_SHARENS", "true")

    def launcher_env(self, env: Env) -> Env:
        return [*((self.ENV_PREFIX + name, value) for name, value in env), self.SHARE_NAMESPACES]

    def bind_args(self, bind: str) -> list[str]:
        return ["--bind", bind]

    def gpu_args(self) -> list[str]:
        return ["--nv"]

    def exec_prefix(self, launch: Launch) -> list[str]:
        return ["apptainer", "exec", *self.options(launch), launch.image or self.default_image]


class Charliecloud(Runtime):
    """``ch-run``; GPUs need the host's driver injected once: ``ch-fromhost --nvidia IMAGE``."""

    name, default_image = "charliecloud", "ddp-cpu"

    def launcher_env(self, env: Env) -> Env:
        return []

    def bind_args(self, bind: str) -> list[str]:
        return ["-b", bind]

    def exec_prefix(self, launch: Launch) -> list[str]:
        ours = [f"--set-env={name}={value}" for name, value in launch.env]
        return ["ch-run", *self.join_args(launch), *self.options(launch), "--set-env", *ours,
                launch.image or self.default_image, "--"]

    #: under srun: the job, its attempt (a requeue is a new one) and the shell that runs the
    #: line, expanded by that shell. ch-run takes a tag as written and srun starts it with no
    #: shell, so the step's SLURM_STEP_ID, unknown before srun, cannot be part of it.
    SRUN_JOIN_TAG = ShellText('--join-tag="ddp-$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$$"')

    def join_args(self, launch: Launch) -> list[str]:
        """One container per node, not per rank, so that MPI's single-copy transfers work
        between its ranks (launcher/mpi/cma.py). ch-run counts its peers from srun's or Open MPI's
        variables, not Hydra's: the count is given. Under mpirun the group's tag stays ch-run's
        own, the pid of its parent: the launcher's daemon of this job on this node (Hydra's
        proxy, prted). Under srun ch-run's own is SLURM_STEP_ID, 0 in every job: jobs sharing a
        node would join each other, and a join lock that a failed ch-run left behind would stop
        every later job there."""
        count = f"--join-ct={launch.procs_per_node}"
        return [self.SRUN_JOIN_TAG, count] if launch.launcher == "srun" else [count]


class Pyxis(Runtime):
    """Pyxis/enroot: srun's own ``--container-*`` options, nothing in front of the program."""

    name, default_image = "pyxis", "ddp+cpu.sqsh"

    def validate(self, launch: Launch) -> None:
        super().validate(launch)
        if launch.launcher != "srun":
            raise LaunchError(f"--runtime {self.name} is an srun plugin: {launch.launcher} "
                              "cannot use it", hint="pass --launcher srun")

    def bind_args(self, bind: str) -> list[str]:
        return [bind]

    def srun_options(self, launch: Launch) -> list[str]:
        options = [f"--container-image={launch.image or self.default_image}"]
        if launch.binds:
            options.append("--container-mounts=" + ",".join(launch.binds))
        if launch.env:
            options.append("--container-env=" + ",".join(name for name, _ in launch.env))
        return options


class PodmanHpc(Runtime):
    name, default_image = "podman-hpc", "ddp:cpu"

    def launcher_env(self, env: Env) -> Env:
        return []

    def bind_args(self, bind: str) -> list[str]:
        return ["-v", bind]

    def gpu_args(self) -> list[str]:
        return ["--gpu"]

    def exec_prefix(self, launch: Launch) -> list[str]:
        variables = [arg for name, value in launch.env for arg in ("-e", f"{name}={value}")]
        return ["podman-hpc", "run", "--rm", "--mpi", *self.options(launch), *variables,
                launch.image or self.default_image]


class Docker(Runtime):
    """The compose cluster: ``docker exec`` into node0, where mpiexec reaches the others over
    ssh; or, with ``--image``, one node in ``docker run IMAGE``. Hydra runs inside either."""

    name = "docker"

    def prepare(self, launch: Launch) -> Launch:
        """The cluster's node0..node{N-1} unless hosts are named, and DDP_HOSTS: Hydra exports
        no node list, and with it each rank names its interface (the route to another node)
        before MPI starts, also on the node whose own name is loopback."""
        if launch.image or launch.hostfile:
            return launch
        hosts = launch.hosts or tuple(cluster_hosts(launch.nodes))
        if "DDP_HOSTS" not in dict(launch.env):
            launch = replace(launch, env=(*launch.env, ("DDP_HOSTS", ",".join(hosts))))
        return replace(launch, hosts=hosts)

    def validate(self, launch: Launch) -> None:
        super().validate(launch)
        if launch.launcher != "mpirun":
            others = [name for name in RUNTIMES if name != self.name]
            raise LaunchError(
                f"--runtime {self.name} cannot be started by {launch.launcher}",
                hint=f"on Slurm use --runtime {', '.join(others[:-1])} or {others[-1]}; "
                "docker is for the compose cluster with --launcher mpirun",
            )
        if launch.image and (launch.nodes > 1 or launch.hosts):
            raise LaunchError(
                f"--runtime docker --image {launch.image} runs one node in `docker run`, not "
                f"{launch.nodes} nodes",
                hint="leave --image out to use the compose cluster (invoke cluster.up --nodes N), "
                "or pass --nodes 1",
            )
        if launch.mpi != "mpich":
            raise LaunchError(
                f"--runtime docker with --mpi {launch.mpi}: the image ships MPICH's Hydra only",
                hint="pass --mpi mpich (the default)",
            )
        if launch.hostfile:
            raise LaunchError(
                "--runtime docker takes no --hostfile: mpiexec starts in the first node's "
                "container", hint="pass --hosts node0,node1 or leave it out for node0..node{N-1}",
            )

    def outer(self, launch: Launch) -> list[str]:
        if not launch.image:
            return ["docker", "exec", launch.container_prefix + launch.hosts[0]]
        # /dev/shm for the node's ranks (launcher.placement.shm; Docker's 64 MiB crashes or hangs
        # MPI_Init) and unlimited locked memory for RDMA registration
        size = shm.docker_size(shm.recommended_shm(launch.procs_per_node))
        return ["docker", "run", "--rm", f"--shm-size={size}", "--ulimit", "memlock=-1",
                launch.image]


#: every runtime by its --runtime name, in the order help texts list them
RUNTIMES: dict[str, type[Runtime]] = {
    cls.name: cls for cls in (Apptainer, Charliecloud, Pyxis, PodmanHpc, Docker, Runtime)
}
