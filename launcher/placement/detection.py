"""Which detector wins (the first of ``DETECTORS`` that claims the environment), and the checks
across launchers on what it read: each index below its count, and no second launcher's
variables that disagree."""

from __future__ import annotations

from launcher.core.errors import LaunchError
from launcher.placement.detectors import DETECTORS, Detector
from launcher.placement.variables import Environ, Placement, read_int

# launchers whose rank/size must agree with the chosen one when both are present; torchrun is
# left out because an outer launcher legitimately describes its agents, not its workers
_CROSS_CHECKED: tuple[tuple[str, str, str], ...] = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
    ("PMI (MPICH, Intel MPI, Cray, srun --mpi=pmi2)", "PMI_RANK", "PMI_SIZE"),
)


def _check_conflicts(chosen: Detector, placement: Placement, environ: Environ) -> None:
    if chosen.name in ("torchrun", "single"):
        return
    for label, rank_name, size_name in _CROSS_CHECKED:
        if rank_name not in environ or size_name not in environ:
            continue
        rank = read_int(environ, rank_name, label)
        size = read_int(environ, size_name, label, minimum=1)
        if (rank, size) != (placement.rank, placement.world_size):
            raise LaunchError(
                f"launchers disagree: {chosen.name} says rank {placement.rank} of "
                f"{placement.world_size}, but {rank_name}={rank} {size_name}={size} ({label})",
                hint=f"variables of two launchers are mixed; unset the {label} ones "
                f"({rank_name}, {size_name}) if they were exported by hand or inherited from "
                "an outer launcher",
            )


def _check_ranges(name: str, p: Placement) -> None:
    checks = (
        ("rank", p.rank, "world size", p.world_size),
        ("local rank", p.local_rank, "local world size", p.local_world_size),
        ("node rank", p.node_rank, "number of nodes", p.num_nodes),
    )
    for what, value, limit_name, limit in checks:
        if value >= limit:
            raise LaunchError(
                f"{name}: {what} {value} is not below the {limit_name} {limit}",
                hint="the launch variables are inconsistent; if you exported RANK/WORLD_SIZE "
                "or similar by hand, unset them and let the launcher set them",
            )
    if p.local_world_size > p.world_size:
        raise LaunchError(
            f"{name}: local world size {p.local_world_size} exceeds world size {p.world_size}",
            hint="the launch variables are inconsistent; unset hand-made ones",
        )


def detect_launcher(environ: Environ) -> tuple[Detector, Placement]:
    """The first detector that claims ``environ``, and the checked placement it read."""
    chosen = next(d for d in DETECTORS if d.detect(environ))
    placement = chosen.read(environ)
    _check_ranges(chosen.name, placement)
    _check_conflicts(chosen, placement, environ)
    return chosen, placement
