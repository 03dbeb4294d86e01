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
from launcher.placement.hostlist import expand_hostlist, expand_tasks_per_node
from launcher.placement.ports import slurm_port
from launcher.placement.variables import (
    Environ,
    Placement,
    block_placement,
    read_int,
    require,
    restart_count,
)

#: Slurm step ids at or above this are special steps (batch, extern, interactive), not tasks
_SLURM_SPECIAL_STEP = 0xFFFFFFF0

# Slurm exports these step ids as numbers or names depending on the version
_SLURM_SPECIAL_STEP_NAMES = {"batch", "extern", "interactive", "pending"}

#: env:// variables a script copies from SLURM_* (or enroot's PyTorch hook does) -> Placement's
_COPIED_BY_HAND = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank",
                   "LOCAL_WORLD_SIZE": "local_world_size"}


class Detector:
    """One launcher: ``detect`` says whether it started us, ``read`` where it put us."""

    name = ""
    #: whether the PMI variables this process sees (``JobEnv.pmi``) are this launcher's for it;
    #: False where they are an outer launcher's, for the process that started this one
    serves_pmi = True

    def detect(self, environ: Environ) -> bool:
        raise NotImplementedError

    def read(self, environ: Environ) -> Placement:
        raise NotImplementedError


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


class Slurm(Detector):
    name = "slurm"

    @staticmethod
    def step_id(environ: Environ) -> str | None:
        return environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))

    @staticmethod
    def is_step(environ: Environ) -> bool:
        """True for a task of a real step; false for a batch script or an salloc shell."""
        step = Slurm.step_id(environ)
        if step is None or "SLURM_PROCID" not in environ:
            return False
        step = step.strip()
        if step in _SLURM_SPECIAL_STEP_NAMES:
            return False
        return not (step.isdigit() and int(step) >= _SLURM_SPECIAL_STEP)

    @staticmethod
    def job_id(environ: Environ) -> str | None:
        return environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))

    def detect(self, environ: Environ) -> bool:
        return self.is_step(environ)

    def read(self, environ: Environ) -> Placement:
        label, because = "Slurm", "SLURM_PROCID"
        rank = read_int(environ, "SLURM_PROCID", label)
        size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        size = require(environ, size_name, label, because, minimum=1)
        local_rank = require(environ, "SLURM_LOCALID", label, because)
        node_rank = require(environ, "SLURM_NODEID", label, because)
        hosts: list[str] = []
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if name in environ:
                hosts = expand_hostlist(environ[name], name)
                break
        num_nodes = len(hosts) or node_rank + 1
        if "SLURM_STEP_NUM_NODES" in environ:
            num_nodes = read_int(environ, "SLURM_STEP_NUM_NODES", label, minimum=1)
        local_size = self._local_size(environ, node_rank, size, num_nodes)
        if hosts and len(hosts) != num_nodes:
            raise LaunchError(
                f"the Slurm node list names {len(hosts)} hosts but SLURM_STEP_NUM_NODES="
                f"{num_nodes}",
                hint="the SLURM_* variables come from different steps or jobs; launch with srun "
                "inside one allocation and do not export SLURM_* by hand",
            )
        job_id = self.job_id(environ)
        step = self.step_id(environ)
        placement = Placement(
            rank=rank,
            world_size=size,
            local_rank=local_rank,
            local_world_size=local_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=hosts[0] if hosts else None,
            master_port=slurm_port(job_id, step) if job_id is not None else None,
            hosts=tuple(hosts),
            job_id=job_id,
        )
        _check_copied_by_hand(environ, placement)
        return placement

    @staticmethod
    def _local_size(environ: Environ, node_rank: int, size: int, num_nodes: int) -> int:
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if name in environ:
                counts = expand_tasks_per_node(environ[name], name)
                if node_rank >= len(counts):
                    raise LaunchError(
                        f"SLURM_NODEID={node_rank} but {name}={environ[name]!r} lists "
                        f"{len(counts)} nodes",
                        hint="the SLURM_* variables come from different steps or jobs; launch "
                        "with srun and do not export SLURM_* by hand",
                    )
                return counts[node_rank]
        return -(-size // num_nodes)


def _check_copied_by_hand(environ: Environ, placement: Placement) -> None:
    """RANK and its kin in a Slurm task without torchrun were copied from SLURM_* by hand, and
    torch reads them: copied from another step, or before srun, they would name other ranks."""
    label = "env:// (set by hand)"
    wrong = [
        f"{name}={read_int(environ, name, label)}"
        for name, field in _COPIED_BY_HAND.items()
        if name in environ and read_int(environ, name, label) != getattr(placement, field)
    ]
    if wrong:
        raise LaunchError(
            f"launchers disagree: slurm says rank {placement.rank} of {placement.world_size}, "
            f"local rank {placement.local_rank} of {placement.local_world_size} (SLURM_PROCID="
            f"{environ['SLURM_PROCID']}), but {' '.join(wrong)} (set by hand, no torchrun)",
            hint="under srun unset RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (SLURM_* "
            "say it all), or set them in each task from SLURM_PROCID, SLURM_NTASKS and "
            "SLURM_LOCALID, not once before srun; to start several ranks per task, use torchrun",
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
