"""Where the project's compiled files live (the compiled mpi backend, ``cxx``; the padding of
MPICH's UCX address, ``ucx_address``), and how a build is put there: made in a directory beside
its target, moved in with one rename, so that a rank never loads half a file, and the builds
of another source or torch then removed.

Standard library only: the image's build stage runs ``cxx.py`` with the files beside it alone,
before the project is copied, and ``ucx_address`` is read as the image's Python starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def directory(given: str | None = None) -> Path:
    """``given`` (``DDP_MPI_CXX_DIR``, ``launcher.placement.env.BuildTools``) or
    ``<venv>/lib/ddp-ext``, outside git."""
    return Path(given or Path(sys.prefix) / "lib" / "ddp-ext")


@contextlib.contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A directory to build ``target`` in, beside it (one file system: ``install`` is a
    rename), removed after with whatever the build left there."""
    import tempfile  # here: ``ucx_address`` imports this module as every Python starts

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        yield Path(tmp)


def install(built: Path, target: Path, prefix: str, companions: tuple[str, ...] = ()) -> None:
    """Rename ``built`` to ``target``, its ``companions`` (same stem, those suffixes) first, so
    that a loader that finds the file finds them too; then remove the other ``prefix*.so``
    beside it (other sources' or torch versions' builds) and their companions."""
    for suffix in companions:
        os.replace(built.with_suffix(suffix), target.with_suffix(suffix))
    os.replace(built, target)
    for stale in target.parent.glob(f"{prefix}*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
            for suffix in companions:
                stale.with_suffix(suffix).unlink(missing_ok=True)
