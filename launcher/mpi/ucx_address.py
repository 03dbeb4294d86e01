"""The bundled MPICH's UCX address, zero-padded (``launcher/mpi/ucx_address.cpp`` says why):
built beside the compiled mpi backend (``python -m launcher.mpi.cxx``, ``scripts/bootstrap.sh``,
the image's build stage), loaded by ``launcher.mpi.library.load`` before mpi4py loads libmpi.

Without a compiler nothing is built and MPICH runs as it comes; MPI_Init under Slurm's pmi2
server then depends on the heap (``launcher.mpi.fresh_stack`` makes a failure rarer). Torch
is not imported here: ``load`` runs as the image's Python starts.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("ucx_address.cpp")
_PREFIX = "ddp_ucx_address_"


def ext_dir(given: str | None = None) -> Path:
    """Where the project's compiled files are: ``given`` (``DDP_MPI_CXX_DIR``) or beside the
    venv."""
    return Path(given or Path(sys.prefix) / "lib" / "ddp-ext")


def path(directory: str | None = None) -> Path:
    """The built file, named by a hash of its source."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return ext_dir(directory) / f"{_PREFIX}{digest}.so"


def build(directory: str | None = None, compiler: str = "c++") -> Path:
    """Compile the source into ``directory`` unless it is built already."""
    target = path(directory)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp, target.name)
        subprocess.run([compiler, "-O2", "-g0", "-shared", "-fPIC", "-o", str(built),
                        str(SOURCE), "-ldl"], check=True)
        os.replace(built, target)  # atomic: a rank never loads half a file
    for stale in target.parent.glob(f"{_PREFIX}*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
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
