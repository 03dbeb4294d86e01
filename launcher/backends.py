"""Which torch.distributed backend a rank runs: the user's ``--backend`` mapped to a torch name.

A leaf module: the configuration validates ``--backend`` against ``BACKEND_CHOICES`` without
importing the process group. Names the user may give:

- ``auto``: ``nccl`` when CUDA is usable (``launcher.gpu_sharing`` turns it back to ``gloo``
  when ranks share a GPU, which NCCL refuses); on CPU ``mpi`` when an MPI launcher started the
  ranks through a PMI that the bundled MPICH joins (Hydra's ``mpiexec``, ``srun --mpi=pmi2``),
  where the benchmarks measured it faster than gloo, else ``gloo`` (torchrun, plain python, and
  launchers whose MPI was not measured: Open MPI's ``mpirun``, ``srun --mpi=pmix``, a host MPI
  bound in). docs/training.md gives the figures behind the rule;
- ``nccl``, ``gloo``: PyTorch's own, rendezvous over TCP at ``MASTER_ADDR:MASTER_PORT``;
- ``mpi``: PyTorch's native MPI backend when the wheel has one, else the mpi4py backend of
  ``launcher.mpi_backend`` (stock PyPI wheels have none). Neither needs an address or a port:
  MPI itself is the rendezvous.
"""

from __future__ import annotations

from launcher.errors import LaunchError

BACKEND_CHOICES = ("auto", "nccl", "gloo", "mpi")


def resolve_auto(requested: str, cuda_available: bool, mpi_measured_faster: bool) -> str:
    """The backend ``auto`` stands for (see the module docstring); any other name unchanged.
    ``mpi_measured_faster``: the ranks run under a launcher and MPI where mpi beat gloo."""
    if requested != "auto":
        return requested
    if cuda_available:
        return "nccl"
    return "mpi" if mpi_measured_faster else "gloo"


def select_backend(requested: str, cuda_available: bool, native_mpi: bool) -> str:
    """Map the user's ``--backend`` (``auto`` resolved) to the torch backend to initialise."""
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
    if requested == "mpi" and not native_mpi:
        from launcher import mpi_backend

        return mpi_backend.register()
    return requested
