"""``Launch``: what one launch is, as a value. A leaf: the builders (commands.py), the runtimes
(runtimes.py), the host launchers and the tasks all import it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.core.errors import LaunchError


@dataclass(frozen=True)
class Launch:
    """One launch: NODES x PROCS_PER_NODE ranks of ``python -m MODULE ARGS``.

    ``env`` holds the program's variables in order (see ``commands.program_env``); ``hosts`` is
    empty when the launcher finds the nodes itself (srun, or one node with mpirun).
    """

    nodes: int = 1
    """number of nodes"""

    procs_per_node: int = 1
    """ranks per node, e.g. one per GPU"""

    launcher: str = "mpirun"
    """mpirun (MPI over ssh, or one machine) or srun (inside Slurm)"""

    mpi: str = "mpich"
    """for mpirun: mpich (Hydra mpiexec, the image's MPI) or openmpi"""

    runtime: str = "apptainer"
    """apptainer (`apptainer exec` per rank), charliecloud (`ch-run`), pyxis (srun
    --container-image), podman-hpc, docker (mpiexec inside the compose cluster's node0) or none
    (python on the host)"""

    pmi: str = "pmi2"
    """for srun: --mpi=pmi2 (default; the image's MPICH), pmix (the image's Open MPI) or default
    (the site's MpiDefault)"""

    hosts: tuple[str, ...] = ()
    """one host per node: a,b or n[1-2] (Slurm form); docker default node0..node{N-1}"""

    hostfile: str = ""
    """for mpirun: a host file instead of --hosts"""

    image: str = ""
    """the runtime's image: apptainer ddp-cpu.sif, charliecloud ddp-cpu (a directory from
    `invoke chimage`, or a SIF from `invoke sif`: its partition is mounted with squashfuse for
    the job), pyxis ddp+cpu.sqsh, podman-hpc ddp:cpu (the defaults); docker: one node in
    `docker run IMAGE` instead of the compose cluster"""

    gpus_per_node: int = 0
    """GPUs per node: srun/sbatch --gpus-per-node and apptainer --nv"""

    cpus_per_task: int = 0
    """CPUs per rank for Slurm; also the default OMP_NUM_THREADS"""

    binds: tuple[str, ...] = ()
    """SRC[:DST] bound into the container; the image has empty /opt/host-mpi/lib and /scratch
    for runtimes that cannot create targets"""

    module: str = "launcher.train"
    """Python module to run"""

    args: tuple[str, ...] = ()
    """arguments for the module, one shell-quoted string, e.g. '--epochs 3'"""

    env: tuple[tuple[str, str], ...] = ()
    """every rank's variables, NAME=VALUE: commands.program_env's, then the ones given"""

    container_prefix: str = ""
    """for --runtime docker: the container name prefix given to cluster.up --prefix"""


def choose(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise LaunchError unless ``value`` (given as ``flag``) is one of ``choices``."""
    if value not in choices:
        raise LaunchError(f"unknown {flag} {value!r}", hint=f"choose one of: {', '.join(choices)}")
