"""Container runtimes on the host side: one small class per runtime, with a fixed interface.

Each knows the four things a launch needs from it: the prefix that runs a rank's program in
the image (``exec_prefix``), how the program's variables reach the rank (``launcher_env``:
the names the host launcher must set; ``exec_prefix`` may carry them instead), its bind
syntax, and its GPU flag. ``srun_options`` is for the one runtime that is an srun plugin
(Pyxis). ``RUNTIMES`` lists them by name; ``ddp_tasks.commands`` only asks these methods.

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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddp_tasks.launch_spec import Launch

Env = list[tuple[str, str]]


class Runtime:
    """``none``: the program runs on the host, its variables set by the launcher."""

    name = "none"
    default_image = ""
    #: whether ranks can be started by srun / by mpirun from the host
    srun_ok = True
    mpirun_ok = True

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
    #: transfers work between them (launcher/cma.py). Older versions ignore the variable.
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

    @staticmethod
    def join_args(launch: Launch) -> list[str]:
        """One container per node, not per rank, so that MPI's single-copy transfers work
        between its ranks (launcher/cma.py). ch-run counts its peers from srun's or Open MPI's
        variables, not Hydra's: the count is given. The group's tag stays ch-run's own:
        SLURM_STEP_ID under srun, else the pid of ch-run's parent, the launcher's daemon of
        this job on this node (Hydra's proxy, prted); a tag in printed text would be shared by
        every job that runs the same line."""
        return [f"--join-ct={launch.procs_per_node}"]


class Pyxis(Runtime):
    """Pyxis/enroot: srun's own ``--container-*`` options, nothing in front of the program."""

    name, default_image = "pyxis", "ddp+cpu.sqsh"
    mpirun_ok = False

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
    """The compose cluster: ``docker exec`` into node0, where mpiexec reaches the others."""

    name = "docker"
    srun_ok = False


RUNTIMES: dict[str, Runtime] = {
    runtime.name: runtime
    for runtime in (Apptainer(), Charliecloud(), Pyxis(), PodmanHpc(), Docker(), Runtime())
}
