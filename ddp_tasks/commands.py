"""Pure builders of the launch command lines (the batch script around them: batch_script.py).

Nothing here starts a process or reads the environment: each function maps its arguments to an
argv list or to text, so tests/test_commands.py compares the results with golden files.

A command is kept as *segments* (launcher, environment, container, program) so that it prints
one segment per line, joined by backslash-newlines: the printed text is exactly what
``invoke run`` hands to the shell, and it can be pasted as it is.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import replace

from ddp_tasks.compose_spec import hosts as cluster_hosts
from ddp_tasks.launch_spec import Launch
from ddp_tasks.runtimes import RUNTIMES as RUNTIME_CLASSES
from launcher import shm
from launcher.env import parse_signal
from launcher.errors import LaunchError

LAUNCHERS = ("mpirun", "srun")
MPI_FLAVOURS = ("mpich", "openmpi")
RUNTIMES = tuple(RUNTIME_CLASSES)
#: srun --mpi: pmi2 speaks to the image's MPICH, pmix to its Open MPI; "default" leaves it to
#: the site's MpiDefault (launcher.mpi_library picks the matching MPI in the image either way)
SRUN_PMIS = ("pmi2", "pmix", "default")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: srun: seconds the other ranks get to end on their own after the first one ended, then they
#: are killed. Not --kill-on-bad-exit=1: preempted ranks all exit 75 together, and killing the
#: slower ones turns srun's status (the highest of all tasks, 128+N for a signal) into 143, so
#: the job would fail instead of being requeued. A crashed rank still ends the step, this much
#: later.
STEP_EXIT_WAIT = 60

_SEGMENT_JOIN = " \\\n    "


def parse_env(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``["K=V", ...]`` from repeated ``--env K=V`` flags as (name, value) pairs."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise LaunchError(
                f"--env {item!r} is not NAME=VALUE",
                hint="give one variable per flag: --env DDP_DATA=/scratch/data --env FOO=1",
            )
        pairs.append((name, value))
    return tuple(pairs)


def program_env(
    signal_name: str,
    omp_threads: int = 0,
    master_addr: str = "",
    master_port: int = 0,
    ifname: str = "",
    extra: tuple[tuple[str, str], ...] = (),
) -> tuple[tuple[str, str], ...]:
    """The variables every rank's program needs, in a fixed order; ``extra`` wins on a clash.

    Rank, size and the rendezvous address are not here: launcher.env reads them from the
    launcher's own variables. MASTER_ADDR/MASTER_PORT and the interface are passed only when
    given, because the right values depend on the site.
    """
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(omp_threads or 1),
        "DDP_PREEMPT_SIGNAL": parse_signal(signal_name, "--signal"),
    }
    if master_addr:
        env["MASTER_ADDR"] = master_addr
    if master_port:
        env["MASTER_PORT"] = str(master_port)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
    env.update(extra)
    return tuple(env.items())


def with_resume(module: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """``--resume auto`` first for launcher.train, so a requeued job continues, unless given."""
    if module != "launcher.train" or any(a.split("=")[0] == "--resume" for a in args):
        return args
    return ("--resume", "auto", *args)


def validate(launch: Launch) -> None:
    """Raise LaunchError for a launch that cannot work, naming the flag to change."""
    _choose("--launcher", launch.launcher, LAUNCHERS)
    _choose("--mpi", launch.mpi, MPI_FLAVOURS)
    _choose("--runtime", launch.runtime, RUNTIMES)
    _choose("--pmi", launch.pmi, SRUN_PMIS)
    runtime = RUNTIME_CLASSES[launch.runtime]
    for flag, value in (("--nodes", launch.nodes), ("--procs-per-node", launch.procs_per_node)):
        if value < 1:
            raise LaunchError(f"{flag} {value} must be at least 1", hint=f"pass {flag} 1 or more")
    for flag, value in (("--gpus-per-node", launch.gpus_per_node),
                        ("--cpus-per-task", launch.cpus_per_task)):
        if value < 0:
            raise LaunchError(f"{flag} {value} is negative", hint=f"leave {flag} out or pass 1+")
    if launch.hosts and launch.hostfile:
        raise LaunchError("both --hosts and --hostfile given", hint="pass only one of them")
    if launch.hosts and len(launch.hosts) != launch.nodes:
        raise LaunchError(
            f"--hosts names {len(launch.hosts)} host(s) but --nodes is {launch.nodes}",
            hint=f"name one host per node, or pass --nodes {len(launch.hosts)}",
        )
    if launch.binds and not runtime.binds:
        able = ", ".join(name for name, r in RUNTIME_CLASSES.items() if r.binds)
        raise LaunchError(f"--bind needs a container runtime that binds ({able}), "
                          f"not {launch.runtime}", hint="drop --bind, or pass --runtime with one")
    if launch.launcher == "mpirun" and not runtime.mpirun_ok:
        raise LaunchError(f"--runtime {launch.runtime} is an srun plugin: mpirun cannot use it",
                          hint="pass --launcher srun")
    if launch.launcher == "srun":
        _validate_srun(launch)
    elif launch.runtime == "docker":
        _validate_docker(launch)
    elif launch.nodes > 1 and not (launch.hosts or launch.hostfile):
        raise LaunchError(
            f"mpirun on {launch.nodes} nodes needs to know which nodes",
            hint="pass --hosts a,b (or n[1-2]) or --hostfile FILE; inside a Slurm allocation "
            "use --launcher srun",
        )


def _choose(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LaunchError(f"unknown {flag} {value!r}", hint=f"choose one of: {', '.join(choices)}")


def _validate_srun(launch: Launch) -> None:
    if not RUNTIME_CLASSES[launch.runtime].srun_ok:
        raise LaunchError(
            "--runtime docker cannot be started by srun",
            hint="on Slurm use --runtime apptainer, charliecloud, pyxis, podman-hpc or none; "
            "docker is for the compose cluster with --launcher mpirun",
        )
    if launch.hostfile:
        raise LaunchError("srun takes no --hostfile", hint="pass --hosts a,b (becomes --nodelist)")
    for name, value in launch.env:
        if "," in value:
            raise LaunchError(
                f"srun cannot pass {name}={value!r}: --export splits its list at commas",
                hint=f"export {name} in your shell instead; srun passes it on with --export=ALL",
            )


def _validate_docker(launch: Launch) -> None:
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
            "--runtime docker takes no --hostfile: mpiexec starts in the first node's container",
            hint="pass --hosts node0,node1 or leave it out for node0..node{N-1}",
        )


def program_argv(launch: Launch) -> list[str]:
    """``python -m MODULE ARGS``: ``python`` is the image's venv (or the host's) on PATH."""
    return ["python", "-m", launch.module, *launch.args]


def container_argv(launch: Launch) -> list[str]:
    """The hybrid model: the host's launcher starts the runtime once per rank."""
    return RUNTIME_CLASSES[launch.runtime].exec_prefix(launch)


def passed_env(launch: Launch) -> list[tuple[str, str]]:
    """The program's variables under the names the host launcher must set (runtimes.py)."""
    return RUNTIME_CLASSES[launch.runtime].launcher_env(list(launch.env))


def mpich_argv(launch: Launch) -> tuple[list[str], list[str]]:
    """Hydra's ``mpiexec`` and its ``-genv`` options."""
    argv = ["mpiexec", "-n", str(launch.nodes * launch.procs_per_node),
            "-ppn", str(launch.procs_per_node)]
    if launch.hosts:
        argv += ["-hosts", ",".join(launch.hosts)]
    if launch.hostfile:
        argv += ["-f", launch.hostfile]
    if launch.hosts or launch.hostfile:
        # Hydra would pick Slurm's launcher inside an allocation; named hosts mean ssh
        argv += ["-launcher", "ssh"]
    env = [arg for name, value in passed_env(launch) for arg in ("-genv", name, value)]
    return argv, env


def openmpi_argv(launch: Launch) -> tuple[list[str], list[str]]:
    """Open MPI's ``mpirun`` and its ``-x`` options (it forwards no other variables)."""
    ppn = launch.procs_per_node
    argv = ["mpirun", "-np", str(launch.nodes * ppn), "--map-by", f"ppr:{ppn}:node"]
    if launch.hosts:
        argv += ["-H", ",".join(f"{host}:{ppn}" for host in launch.hosts)]
    if launch.hostfile:
        argv += ["--hostfile", launch.hostfile]
    env = [arg for name, value in passed_env(launch) for arg in ("-x", f"{name}={value}")]
    return argv, env


def srun_argv(launch: Launch) -> tuple[list[str], list[str]]:
    """``srun`` with the PMI asked for (PMI-2 by default: the image's MPICH speaks it)."""
    argv = ["srun", "--nodes", str(launch.nodes), "--ntasks-per-node", str(launch.procs_per_node)]
    if launch.hosts:
        argv += ["--nodelist", ",".join(launch.hosts)]
    if launch.gpus_per_node:
        argv += ["--gpus-per-node", str(launch.gpus_per_node)]
    if launch.cpus_per_task:
        # since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task
        argv += ["--cpus-per-task", str(launch.cpus_per_task)]
    if launch.pmi != "default":
        argv.append(f"--mpi={launch.pmi}")
    argv += ["--kill-on-bad-exit=0", f"--wait={STEP_EXIT_WAIT}"]
    argv += RUNTIME_CLASSES[launch.runtime].srun_options(launch)
    env = ["--export=" + ",".join(["ALL", *(f"{n}={v}" for n, v in passed_env(launch))])]
    return argv, env


def docker_run_argv(launch: Launch) -> list[str]:
    """One node in one container: /dev/shm for its ranks (``launcher.shm``; Docker's 64 MiB
    crashes or hangs MPI_Init) and unlimited locked memory for RDMA registration."""
    size = shm.docker_size(shm.recommended_shm(launch.procs_per_node))
    return ["docker", "run", "--rm", f"--shm-size={size}", "--ulimit", "memlock=-1",
            launch.image]


def launch_segments(launch: Launch) -> list[list[str]]:
    """The whole command as non-empty segments; raises LaunchError for a bad ``launch``."""
    if launch.runtime == "docker" and launch.image:
        validate(launch)
        launcher, env = mpich_argv(launch)
        return [docker_run_argv(launch), launcher, env, program_argv(launch)]
    if launch.runtime == "docker" and not (launch.hosts or launch.hostfile):
        launch = replace(launch, hosts=tuple(cluster_hosts(launch.nodes)))
    validate(launch)
    if launch.runtime == "docker" and "DDP_HOSTS" not in dict(launch.env):
        # Hydra exports no node list: with it each rank names its interface (the route to
        # another node) before MPI starts, also on the node whose own name is loopback
        launch = replace(launch, env=(*launch.env, ("DDP_HOSTS", ",".join(launch.hosts))))
    if launch.launcher == "srun":
        launcher, env = srun_argv(launch)
    elif launch.mpi == "openmpi":
        launcher, env = openmpi_argv(launch)
    else:
        launcher, env = mpich_argv(launch)
    segments = [launcher, env, container_argv(launch), program_argv(launch)]
    if launch.runtime == "docker":
        # mpiexec runs inside the first node's container and reaches the others over ssh
        segments.insert(0, ["docker", "exec", launch.container_prefix + launch.hosts[0]])
    return [segment for segment in segments if segment]


def render(segments: list[list[str]]) -> str:
    """Shell text of a command, one segment per line."""
    return _SEGMENT_JOIN.join(shlex.join(segment) for segment in segments)
