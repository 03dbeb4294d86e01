"""The Slurm detector: a task of a Slurm step (``srun``), read from SLURM_*; and the check that
RANK and its kin, where a script or enroot's hook copied them from SLURM_* by hand, agree.

A leaf of the detectors: the others ask ``Slurm.is_step`` whether they run inside a step
(``launcher.placement.detectors`` says in which order and why)."""

from __future__ import annotations

from launcher.core.errors import LaunchError
from launcher.placement.hostlist import expand_hostlist, expand_tasks_per_node
from launcher.placement.ports import slurm_port
from launcher.placement.variables import Detector, Environ, Placement, read_int, require

#: Slurm step ids at or above this are special steps (batch, extern, interactive), not tasks
_SLURM_SPECIAL_STEP = 0xFFFFFFF0

# Slurm exports these step ids as numbers or names depending on the version
_SLURM_SPECIAL_STEP_NAMES = {"batch", "extern", "interactive", "pending"}

#: env:// variables a script copies from SLURM_* (or enroot's PyTorch hook does) -> Placement's
_COPIED_BY_HAND = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank",
                   "LOCAL_WORLD_SIZE": "local_world_size"}


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
