"""Which torch.distributed backend a rank runs, and what starting it takes: one plan.

A leaf module: the configuration validates ``--backend`` against ``BACKEND_CHOICES`` without
importing the process group, and ``plan(requested, env, facts)`` decides everything from the
job's environment and a few facts measured beforehand (``BackendFacts``), without touching MPI,
torch or the environment; ``launcher.group.process_group`` carries the plan out. Names the user may
give:

- ``auto``: ``nccl`` when CUDA is usable (turned back to ``gloo`` when ranks share a GPU, which
  NCCL refuses: ``BackendPlan.if_gpu_shared``); on CPU ``mpi`` when an MPI launcher started the
  ranks through a PMI that the bundled MPICH joins (Hydra's ``mpiexec``, ``srun --mpi=pmi2``),
  where the benchmarks measured it faster than gloo, else ``gloo`` (torchrun, plain python, and
  launchers whose MPI was not measured: Open MPI's ``mpirun``, ``srun --mpi=pmix``, a host MPI
  bound in). docs/training.md gives the figures behind the rule;
- ``nccl``, ``gloo``: PyTorch's own, rendezvous through a TCP store at ``MASTER_ADDR:MASTER_PORT``.
  MPI starts for them only where the rendezvous needs it: under an MPI launcher, whose ranks
  agree on the address, port and node list over ``MPI.COMM_WORLD`` (``launcher.group.rendezvous``);
- ``mpi``: PyTorch's native MPI backend when the wheel has one and the ranks run on CPU, else
  the launcher's own (``launcher.mpi.backend``; stock PyPI wheels have no native one). On GPUs
  the native one refuses CUDA tensors unless its MPI is CUDA-aware, which the image's MPICH is
  not, and has no bf16 or fp16 (pytorch#139178); the launcher's stages them through host
  memory. Neither needs an address or a port: MPI itself is the rendezvous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.core.errors import LaunchError

if TYPE_CHECKING:
    from launcher.placement.env import JobEnv

BACKEND_CHOICES = ("auto", "nccl", "gloo", "mpi")
#: the name ``launcher.mpi.backend`` registers its Python process group under
MPI4PY = "mpi4py"
#: launchers that start no rendezvous of their own: their ranks agree on one over MPI
MPI_LAUNCHERS = frozenset({"openmpi", "mvapich", "pals", "hydra"})


@dataclass(frozen=True)
class BackendFacts:
    """What the plan needs to know about this rank and its software, found out beforehand."""

    cuda_available: bool
    #: torch was built with MPI (``torch.distributed.is_mpi_available()``)
    native_mpi: bool
    #: the libmpi mpi4py would load is the bundled MPICH (``launcher.mpi.library.chosen``)
    bundled_mpich: bool


@dataclass(frozen=True)
class BackendPlan:
    """How this rank joins the job: what ``launcher.group.process_group`` does, and why."""

    #: the torch backend to initialise: "nccl", "gloo", "mpi" (native) or "mpi4py"
    backend: str
    #: MPI must be started (``launcher.group.rendezvous.start_mpi``) before the group
    start_mpi: bool
    #: a TCP store hosted by rank 0 is the rendezvous (gloo, nccl)
    store: bool
    #: for nccl: what ranks that share a GPU do: "gloo" (``auto`` falls back) or "refuse"
    if_gpu_shared: str | None
    reason: str


def mpi_measured_faster(env: JobEnv, facts: BackendFacts) -> bool:
    """Whether the mpi backend beat gloo in the benchmarks for this launch: several ranks
    started through PMI-1/PMI-2 (Hydra's mpiexec, srun --mpi=pmi2) on the bundled MPICH."""
    return env.is_distributed and env.pmi == "pmi" and facts.bundled_mpich


def rendezvous_over_mpi(env: JobEnv) -> bool:
    """Whether the store's address, port and node list are agreed on over MPI."""
    return env.is_distributed and env.launcher in MPI_LAUNCHERS


def plan(requested: str, env: JobEnv, facts: BackendFacts) -> BackendPlan:
    """The plan for ``--backend requested`` on this rank (see the module docstring)."""
    resolved, why = resolve_auto(requested, facts.cuda_available, mpi_measured_faster(env, facts))
    name = select_backend(resolved, facts.cuda_available, facts.native_mpi)
    if resolved == "mpi":
        if facts.native_mpi and name == MPI4PY:
            why += "; not torch's own MPI backend, which refuses CUDA tensors on this MPI"
        return BackendPlan(name, start_mpi=True, store=False, if_gpu_shared=None,
                           reason=f"{why}; MPI is the rendezvous")
    over_mpi = rendezvous_over_mpi(env)
    shared = None
    if name == "nccl" and env.is_distributed:
        shared = "refuse" if requested == "nccl" else "gloo"
    how = ("address agreed on over MPI" if over_mpi else "address given by the launcher")
    return BackendPlan(name, start_mpi=over_mpi, store=True, if_gpu_shared=shared,
                       reason=f"{why}; TCP store rendezvous, {how}")


def resolve_auto(requested: str, cuda_available: bool, mpi_measured: bool) -> tuple[str, str]:
    """The backend ``auto`` stands for, and why; any other name unchanged.
    ``mpi_measured``: the ranks run under a launcher and MPI where mpi beat gloo."""
    if requested != "auto":
        return requested, f"--backend {requested}"
    if cuda_available:
        return "nccl", "auto: CUDA is usable"
    if mpi_measured:
        return "mpi", "auto: on CPU, MPI was measured faster than gloo for this launch"
    return "gloo", "auto: on CPU, MPI was not measured faster for this launch"


def select_backend(requested: str, cuda_available: bool, native_mpi: bool) -> str:
    """The torch backend for a resolved ``--backend``; a LaunchError for one that cannot run."""
    if requested not in BACKEND_CHOICES or requested == "auto":
        raise LaunchError(
            f"unknown backend {requested!r}",
            hint=f"use one of: {', '.join(BACKEND_CHOICES)}",
        )
    if requested == "nccl" and not cuda_available:
        raise LaunchError(
            "--backend nccl needs CUDA, and no usable GPU was found on this rank",
            hint="use --backend gloo or mpi on CPU nodes (launcher.distributed(backend=\"gloo\") "
            "in a script of your own), or run with GPUs (--nv for apptainer, --gpus all for "
            "docker)",
        )
    if requested == "mpi" and (not native_mpi or cuda_available):
        return MPI4PY
    return requested
