"""The image flavors: what each changes from docker/Dockerfile's defaults, in one record each.

A flavor's versions stay in the Dockerfile's ARGs (the single source of truth, which are the cpu
ones); a ``Flavor`` holds only what differs between flavors. Every task that takes ``--flavor``
calls ``get`` first, so an unknown name is one ``error:`` and one ``HINT:`` before any work.
Builders that only put the name into a tag or a file name take the name; those that need the
flavor's data take the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from launcher.core.errors import LaunchError

DEFAULT = "cpu"


@dataclass(frozen=True)
class Flavor:
    name: str
    #: one line for the tasks' --flavor help
    summary: str
    #: PyTorch's index its torch comes from; "" for PyPI itself
    torch_index: str
    #: the local version of its torch wheel (``2.13.0+cpu``); "" for PyPI's plain version
    torch_local: str
    #: build arguments it changes from the Dockerfile's defaults
    build_args: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: the ``%help`` section of its Apptainer definition
    sif_help: str = ""

    def fits_wheel(self, filename: str) -> bool:
        """Whether a wheelhouse file may be offered to pip for this flavor: a torch wheel with a
        local version never is to a flavor without one, since ``torch==X`` matches ``X+cpu``
        and pip prefers that local version."""
        if self.torch_local or not filename.startswith("torch-"):
            return True
        return "+" not in filename.split("-")[1]


_CPU = Flavor(
    name="cpu",
    summary="cpu (CPU torch)",
    torch_index="https://download.pytorch.org/whl/cpu",
    torch_local="cpu",
    sif_help="""\
    PyTorch DistributedDataParallel over MPI, Slurm and torchrun (docs/image.md), CPU.
    Self-check on a Slurm allocation:
      srun --mpi=pmi2 apptainer exec ddp-cpu.sif python -m launcher.check --backend mpi
    With the host's MPI bound in instead of the image's:
      APPTAINERENV_LD_LIBRARY_PATH=/opt/host-mpi/lib srun --mpi=pmix \\
        apptainer exec --bind /path/to/host/mpi/lib:/opt/host-mpi/lib ddp-cpu.sif \\
        python -m launcher.check --backend mpi""",
)

# Both flavors share the Debian base; cuda's versions are those torch's wheel requires (==)
# and the build checks them; only the driver comes from the host at run time. PyPI's default
# Linux torch is the CUDA build and brings the CUDA user space as wheels.
_CUDA = Flavor(
    name="cuda",
    summary="cuda (PyPI's CUDA torch with the CUDA user space, cuDNN and NCCL as wheels)",
    torch_index="",
    torch_local="",
    build_args=MappingProxyType({
        "CUDA_VERSION": "13.0",
        "CUDNN_VERSION": "9.20.0.48",
        "NCCL_VERSION": "2.29.7",
        "NVIDIA_VISIBLE_DEVICES": "all",
    }),
    sif_help="""\
    PyTorch DistributedDataParallel over MPI, Slurm and torchrun (docs/image.md), CUDA.
    The GPU driver comes from the host: always pass --nv (Apptainer binds the driver's
    libraries and the devices), one GPU per rank:
      srun --mpi=pmi2 --gpus-per-task=1 apptainer exec --nv ddp-cuda.sif \\
        python -m launcher.check --backend nccl
    Without --nv, torch finds no GPU and launcher.check reports CUDA absent.""",
)

FLAVORS = MappingProxyType({flavor.name: flavor for flavor in (_CPU, _CUDA)})
NAMES = tuple(FLAVORS)
#: the --flavor help of every task that builds one
HELP = " or ".join(flavor.summary for flavor in FLAVORS.values()) + "; both on the Debian base"


def get(name: str) -> Flavor:
    """The flavor called NAME, or a LaunchError that lists the flavors."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise LaunchError(f"unknown image flavor {name!r}",
                          hint=f"use one of: {', '.join(NAMES)}") from None
