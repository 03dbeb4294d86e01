"""Host launchers: what starts the ranks from the host, one small class per launcher, with the
same shape as the container runtimes (runtimes.py).

Each knows its own command line for a launch (``argv``), how it passes the program's variables
to every rank (``env_args``: the names come from the runtime's ``launcher_env``), and what it
cannot do (``validate``). ``HOST_LAUNCHERS`` is tried in order: the first class whose ``name``
is the launch's ``--launcher`` and whose ``mpi`` is its ``--mpi`` (or any) starts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_tasks.launch_spec import choose
from launcher.core.errors import LaunchError

if TYPE_CHECKING:
    from ddp_tasks.launch_spec import Launch
    from ddp_tasks.runtimes import Env, Runtime


class HostLauncher:
    """The interface; ``name`` is the ``--launcher`` value, ``mpi`` the ``--mpi`` it serves."""

    name = ""
    mpi = ""  # empty: any --mpi (the image's MPI follows the launcher's PMI instead)

    def argv(self, launch: Launch, runtime: Runtime) -> list[str]:
        raise NotImplementedError

    def env_args(self, env: Env) -> list[str]:
        raise NotImplementedError

    def validate(self, launch: Launch, runtime: Runtime) -> None:
        """Raise LaunchError for what this launcher cannot do, naming the flag to change."""


class Mpirun(HostLauncher):
    """An MPI library's own launcher on the host: over ssh to named hosts, or on this machine."""

    name = "mpirun"

    def validate(self, launch: Launch, runtime: Runtime) -> None:
        if launch.nodes > 1 and not (launch.hosts or launch.hostfile):
            raise LaunchError(
                f"mpirun on {launch.nodes} nodes needs to know which nodes",
                hint="pass --hosts a,b (or n[1-2]) or --hostfile FILE; inside a Slurm allocation "
                "use --launcher srun",
            )


class Hydra(Mpirun):
    """MPICH's Hydra ``mpiexec`` and its ``-genv`` options."""

    mpi = "mpich"

    def argv(self, launch: Launch, runtime: Runtime) -> list[str]:
        argv = ["mpiexec", "-n", str(launch.nodes * launch.procs_per_node),
                "-ppn", str(launch.procs_per_node)]
        if launch.hosts:
            argv += ["-hosts", ",".join(launch.hosts)]
        if launch.hostfile:
            argv += ["-f", launch.hostfile]
        if launch.hosts or launch.hostfile:
            # Hydra would pick Slurm's launcher inside an allocation; named hosts mean ssh
            argv += ["-launcher", "ssh"]
        return argv

    def env_args(self, env: Env) -> list[str]:
        return [arg for name, value in env for arg in ("-genv", name, value)]


class OpenMpi(Mpirun):
    """Open MPI's ``mpirun`` and its ``-x`` options (it forwards no other variables)."""

    mpi = "openmpi"

    def argv(self, launch: Launch, runtime: Runtime) -> list[str]:
        ppn = launch.procs_per_node
        argv = ["mpirun", "-np", str(launch.nodes * ppn), "--map-by", f"ppr:{ppn}:node"]
        if launch.hosts:
            argv += ["-H", ",".join(f"{host}:{ppn}" for host in launch.hosts)]
        if launch.hostfile:
            argv += ["--hostfile", launch.hostfile]
        return argv

    def env_args(self, env: Env) -> list[str]:
        return [arg for name, value in env for arg in ("-x", f"{name}={value}")]


class Srun(HostLauncher):
    """``srun`` with the PMI asked for (PMI-2 by default: the image's MPICH speaks it)."""

    name = "srun"
    #: --mpi: pmi2 speaks to the image's MPICH, pmix to its Open MPI; "default" leaves it to the
    #: site's MpiDefault (launcher.mpi.library picks the matching MPI in the image either way)
    PMIS = ("pmi2", "pmix", "default")
    #: seconds the other ranks get to end on their own after the first one ended, then they
    #: are killed. Not --kill-on-bad-exit=1: preempted ranks all exit 75 together, and killing
    #: the slower ones turns srun's status (the highest of all tasks, 128+N for a signal) into
    #: 143, so the job would fail instead of being requeued. A crashed rank still ends the
    #: step, this much later.
    STEP_EXIT_WAIT = 60

    def argv(self, launch: Launch, runtime: Runtime) -> list[str]:
        argv = ["srun", "--nodes", str(launch.nodes),
                "--ntasks-per-node", str(launch.procs_per_node)]
        if launch.hosts:
            argv += ["--nodelist", ",".join(launch.hosts)]
        if launch.gpus_per_node:
            argv += ["--gpus-per-node", str(launch.gpus_per_node)]
        if launch.cpus_per_task:
            # since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task
            argv += ["--cpus-per-task", str(launch.cpus_per_task)]
        if launch.pmi != "default":
            argv.append(f"--mpi={launch.pmi}")
        argv += ["--kill-on-bad-exit=0", f"--wait={self.STEP_EXIT_WAIT}"]
        return argv + runtime.srun_options(launch)

    def env_args(self, env: Env) -> list[str]:
        return ["--export=" + ",".join(["ALL", *(f"{name}={value}" for name, value in env)])]

    def validate(self, launch: Launch, runtime: Runtime) -> None:
        if launch.hostfile:
            raise LaunchError("srun takes no --hostfile",
                              hint="pass --hosts a,b (becomes --nodelist)")
        # only what goes through --export: ch-run's --set-env and podman-hpc's -e take commas
        for name, value in runtime.launcher_env(list(launch.env)):
            if "," in value:
                raise LaunchError(
                    f"srun cannot pass {name}={value!r}: --export splits its list at commas",
                    hint=f"export {name} in your shell instead; srun passes it on with "
                    "--export=ALL",
                )


#: tried in order by ``host_launcher``
HOST_LAUNCHERS: tuple[type[HostLauncher], ...] = (Hydra, OpenMpi, Srun)
LAUNCHERS = tuple(dict.fromkeys(cls.name for cls in HOST_LAUNCHERS))
MPI_FLAVOURS = tuple(cls.mpi for cls in HOST_LAUNCHERS if cls.mpi)


def host_launcher(launch: Launch) -> HostLauncher:
    """The launcher that starts ``launch``; raises LaunchError for an unknown one."""
    choose("--launcher", launch.launcher, LAUNCHERS)
    choose("--mpi", launch.mpi, MPI_FLAVOURS)
    return next(cls for cls in HOST_LAUNCHERS
                if cls.name == launch.launcher and cls.mpi in ("", launch.mpi))()

