"""Which torch.distributed backend a rank runs: the user's ``--backend`` mapped to a torch name.

A leaf module: the configuration validates ``--backend`` against ``BACKEND_CHOICES`` without
importing the process group. Names the user may give:

- ``auto``: ``nccl`` when CUDA is usable, else ``gloo`` (``launcher.gpu_sharing`` turns it back
  to ``gloo`` when ranks share a GPU, which NCCL refuses);
- ``nccl``, ``gloo``: PyTorch's own, rendezvous over TCP at ``MASTER_ADDR:MASTER_PORT``;
- ``mpi``: PyTorch's native MPI backend when the wheel has one, else the mpi4py backend of
  ``launcher.mpi_backend`` (stock PyPI wheels have none). Neither needs an address or a port:
  MPI itself is the rendezvous.
"""

from __future__ import annotations

from launcher.errors import LaunchError

BACKEND_CHOICES = ("auto", "nccl", "gloo", "mpi")


def select_backend(requested: str, cuda_available: bool, native_mpi: bool) -> str:
    """Map the user's ``--backend`` to the torch backend name to initialise."""
    if requested not in BACKEND_CHOICES:
        raise LaunchError(
            f"unknown backend {requested!r}",
            hint=f"use one of: {', '.join(BACKEND_CHOICES)}",
        )
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise LaunchError(
            "--backend nccl needs CUDA, and no usable GPU was found on this rank",
            hint="use --backend gloo or mpi on CPU nodes, or run with GPUs (--nv for apptainer, "
            "--gpus all for docker)",
        )
    if requested == "mpi" and not native_mpi:
        from launcher import mpi_backend

        return mpi_backend.register()
    return requested
