"""The bundled MPICH's UCX address, zero-padded (``launcher/mpi/ucx_address.cpp`` says why):
built beside the compiled mpi backend (``python -m launcher.mpi.cxx``, ``scripts/bootstrap.sh``,
the image's build stage), loaded by ``launcher.mpi.library.load`` before mpi4py loads libmpi.

Without a compiler nothing is built and MPICH runs as it comes; MPI_Init under Slurm's pmi2
server then depends on the heap (``launcher.mpi.own_arena`` makes a failure rarer). Torch is
not imported here, nor what only a build needs: ``load`` runs as the image's Python starts.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

if __package__:
    from launcher.mpi import ext_files
else:  # the image's build stage: the file beside it
    import ext_files

SOURCE = Path(__file__).with_name("ucx_address.cpp")
_PREFIX = "ddp_ucx_address_"


@functools.cache
def _digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def path(directory: str | None = None) -> Path:
    """The built file, named by a hash of its source."""
    return ext_files.directory(directory) / f"{_PREFIX}{_digest()}.so"


def build(directory: str | None = None, compiler: str = "c++") -> Path:
    """Compile the source into ``directory`` unless it is built already; the compiler's
    failure as ``subprocess.CalledProcessError``, its messages on stderr."""
    import subprocess

    target = path(directory)
    if target.exists():
        return target
    with ext_files.staging(target) as tmp:
        built = tmp / target.name
        subprocess.run([compiler, "-O2", "-g0", "-shared", "-fPIC", "-o", str(built),
                        str(SOURCE), "-ldl"], check=True)
        ext_files.install(built, target, _PREFIX)
    return target


def load(directory: str | None = None) -> Path | None:
    """Put the built file into the process's global scope, where libmpi, loaded after it,
    finds its definitions first; None where it is not built."""
    target = path(directory)
    if not target.exists():
        return None
    ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)
    return target


def padded() -> int | None:
    """How many UCX addresses this process padded; None where the file is not loaded."""
    try:
        return ctypes.CDLL(None).ddp_ucx_addresses_padded()
    except AttributeError:
        return None
