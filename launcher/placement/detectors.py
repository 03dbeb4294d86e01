"""Which launcher started this process, and where it put it: one small class per launcher.

``DETECTORS`` is tried in this order; the first whose ``detect(environ)`` is true wins:

1. ``torchrun``  -- TORCHELASTIC_RUN_ID (torchrun's agent), or RANK outside a Slurm task (env://
   by hand). First because torchrun is often started by srun or mpirun, one agent per node: the
   outer launcher's variables then describe the agent, not the worker, and its PMI serves the
   agent alone (``pmi`` is "none"). RANK without the agent inside a Slurm task was copied from
   SLURM_* by hand (enroot's PyTorch hook under Pyxis, ``RANK=$SLURM_PROCID``): Slurm reads it,
   and the copy must agree.
2. ``openmpi``   -- OMPI_COMM_WORLD_RANK (mpirun from Open MPI).
3. ``mvapich``   -- MV2_COMM_WORLD_RANK (MVAPICH2; its Hydra also sets PMI_*).
4. ``pals``      -- PALS_RANKID with PALS_LOCAL_RANKID (Cray PALS ``mpiexec``; Cray PMI sets PMI_*
   beside it), or PALS_RANKID outside a Slurm task. ``srun --mpi=cray_shasta`` sets PALS_RANKID
   and PALS_NODEID only (no local rank, no size): Slurm wins, as over Hydra below.
5. ``hydra``     -- PMI_RANK with MPI_LOCALRANKID (MPICH and Intel MPI ``mpiexec``), or PMI_RANK
   outside a Slurm step. Before Slurm because ``mpiexec`` inside an allocation inherits the batch
   step's SLURM_PROCID=0, and Hydra's Slurm bootstrap gives each rank the SLURM_* of its proxy
   step (one task per node): neither is the rank.
6. ``slurm``     -- a task of a Slurm step: SLURM_PROCID and SLURM_STEP_ID both set. ``srun
   --mpi=pmi2`` also sets PMI_RANK/PMI_SIZE (no MPI_LOCALRANKID): Slurm wins, it also knows the
   node list. A batch script or an ``salloc`` shell has SLURM_JOB_ID but no step id (the batch
   step's is not exported): it is not a task, so it runs as a single process.
7. ``single``    -- nothing above: one process. PMIX_RANK alone is refused (PMIx exports no
   world size; the launchers that set it also set one of the sets above).

Every variable is parsed strictly; a bad value raises one ``LaunchError`` naming the variable
and the launcher. MPI launchers do not export a node index: ``node_rank``/``num_nodes`` are
derived assuming equally filled nodes, and ``launcher.group.rendezvous`` replaces them with the real
ones (from the host names of all ranks) at start-up.
"""

from __future__ import annotations

from dataclasses import replace

from launcher.core.errors import LaunchError
from launcher.placement.slurm_detector import Slurm
from launcher.placement.variables import (
    Detector,
    Environ,
    Placement,
    block_placement,
    read_int,
    require,
    restart_count,
)


class MpiDetector(Detector):
    """An MPI launcher that exports rank, size, local rank and local size, nothing else."""

    label = ""
    #: JobEnv field -> the variable it is read from
    variables: dict[str, str] = {}

    def detect(self, environ: Environ) -> bool:
        return self.variables["rank"] in environ

    def read(self, environ: Environ) -> Placement:
        names = self.variables
        because = names["rank"]
        rank = read_int(environ, because, self.label)
        size = require(environ, names["world_size"], self.label, because, minimum=1)
        local_rank = require(environ, names["local_rank"], self.label, because)
        local_size = require(environ, names["local_world_size"], self.label, because, minimum=1)
        return block_placement(rank, size, local_rank, local_size)


class OpenMpi(MpiDetector):
    name, label = "openmpi", "Open MPI"
    # OMPI_COMM_WORLD_NODE_RANK is the rank among all jobs' processes on the node, not a node
    # index, so it is not read.
    variables = {
        "rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    }


class Mvapich(MpiDetector):
    name, label = "mvapich", "MVAPICH"
    variables = {
        "rank": "MV2_COMM_WORLD_RANK",
        "world_size": "MV2_COMM_WORLD_SIZE",
        "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
    }


class Hydra(MpiDetector):
    name, label = "hydra", "MPICH/Intel MPI (Hydra)"
    variables = {
        "rank": "PMI_RANK",
        "world_size": "PMI_SIZE",
        "local_rank": "MPI_LOCALRANKID",
        "local_world_size": "MPI_LOCALNRANKS",
    }

    def detect(self, environ: Environ) -> bool:
        return "PMI_RANK" in environ and (
            "MPI_LOCALRANKID" in environ or not Slurm.is_step(environ)
        )


class Pals(MpiDetector):
    name, label = "pals", "Cray PALS"
    variables = {
        "rank": "PALS_RANKID",
        "world_size": "PMI_SIZE",
        "local_rank": "PALS_LOCAL_RANKID",
        "local_world_size": "PALS_LOCAL_SIZE",
    }

    def detect(self, environ: Environ) -> bool:
        return "PALS_RANKID" in environ and (
            "PALS_LOCAL_RANKID" in environ or not Slurm.is_step(environ)
        )

    def read(self, environ: Environ) -> Placement:
        placement = super().read(environ)
        node_rank = placement.node_rank
        if "PALS_NODEID" in environ:
            node_rank = read_int(environ, "PALS_NODEID", self.label)
        return replace(
            placement,
            node_rank=node_rank,
            num_nodes=max(placement.num_nodes, node_rank + 1),
            job_id=environ.get("PALS_APID"),
        )


class Torchrun(Detector):
    name = "torchrun"
    # the workers are no MPI processes of an srun or mpiexec around torchrun: its PMI_FD,
    # PMI_RANK or PMIX_* belong to the agent, and MPI_Init on them aborts
    serves_pmi = False

    def detect(self, environ: Environ) -> bool:
        if "TORCHELASTIC_RUN_ID" in environ:  # the agent always sets it
            return True
        return "RANK" in environ and not Slurm.is_step(environ)

    def read(self, environ: Environ) -> Placement:
        label = "torchrun (env://)"
        because = "TORCHELASTIC_RUN_ID" if "TORCHELASTIC_RUN_ID" in environ else "RANK"
        rank = require(environ, "RANK", label, because)
        size = require(environ, "WORLD_SIZE", label, because, minimum=1)
        local_rank = require(environ, "LOCAL_RANK", label, because)
        # set by hand for env:// these may be missing: then every rank is taken as one node
        local_size = size
        node_rank, num_nodes = 0, 1
        if "LOCAL_WORLD_SIZE" in environ:
            local_size = read_int(environ, "LOCAL_WORLD_SIZE", label, minimum=1)
            num_nodes = -(-size // local_size)
        if "GROUP_RANK" in environ:
            node_rank = read_int(environ, "GROUP_RANK", label)
        if "GROUP_WORLD_SIZE" in environ:
            num_nodes = read_int(environ, "GROUP_WORLD_SIZE", label, minimum=1)
        return Placement(
            rank=rank,
            world_size=size,
            local_rank=local_rank,
            local_world_size=local_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            job_id=environ.get("TORCHELASTIC_RUN_ID"),
            attempt=restart_count(environ),
        )


class Single(Detector):
    name = "single"

    def detect(self, environ: Environ) -> bool:
        return True

    def read(self, environ: Environ) -> Placement:
        if "PMIX_RANK" in environ:
            raise LaunchError(
                f"PMIX_RANK={environ['PMIX_RANK']!r} is set but no launcher variable gives the "
                "world size (PMIx exports none)",
                hint="launch with srun, or an mpirun/mpiexec that sets OMPI_COMM_WORLD_* or "
                "PMI_*; or unset PMIX_RANK to run one process",
            )
        return Placement(0, 1, 0, 1, 0, 1, master_addr="127.0.0.1", job_id=Slurm.job_id(environ))


DETECTORS: tuple[Detector, ...] = (
    Torchrun(), OpenMpi(), Mvapich(), Pals(), Hydra(), Slurm(), Single(),
)  # fmt: skip
