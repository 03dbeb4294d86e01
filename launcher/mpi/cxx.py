"""The mpi backend compiled: ``launcher/mpi/cxx.cpp`` (and the parts it includes), a
``c10d::Backend`` on the MPI library mpi4py loaded, built here and chosen over the Python
backend (``launcher.mpi.backend``) wherever it can run.

``python -m launcher.mpi.cxx`` (``scripts/bootstrap.sh``, the image's build stage) compiles it
against the MPICH beside the venv's Python (``include/mpi.h``, ``lib/libmpi.so.12``, rpath)
into ``DDP_MPI_CXX_DIR`` (default ``<venv>/lib/ddp-ext``; ``JobEnv.mpi_cxx_dir``, read with
``CXX`` by ``launcher.placement.env.build_tools``), outside git. The file is named by a
hash of the source and the torch version, so a re-run with nothing changed finds it and
compiles nothing. Which libmpi it runs on is decided when it loads: the dynamic linker hands it
the ``libmpi.so.12`` mpi4py already loaded (a host's Intel MPI, Cray MPICH or MVAPICH bound in:
the MPICH ABI), never a second one.

``choose(request)`` picks the implementation a rank runs: the compiled one, or the Python one
and one line why: not built, built for another torch, mpi4py on another ABI (Open MPI's
``libmpi.so.40``, the MPI-5 ABI; two MPI libraries in one process are fatal), a different
library seen by the two, or MPI without ``MPI_THREAD_MULTIPLE`` (the compiled backend's
progress thread needs it). ``DDP_MPI_IMPL`` (``JobEnv.mpi_impl``) overrides: ``python`` always
takes the Python backend, ``cxx`` fails where the compiled one cannot run.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

if __package__:
    from launcher.mpi import ext_files, ucx_address
else:  # run as a file of its own (the image's build stage): the files beside it
    import ext_files
    import ucx_address

BACKEND_NAME = "mpi_cxx"
#: the C++: cxx.cpp and the parts it includes (docker/Dockerfile copies each by name)
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cxx.cpp", "cxx_types.h", "cxx_work.h", "cxx_queue.h", "cxx_build.h",
                             "cxx_backend.h"))
_PREFIX = "ddp_mpi_cxx_"
#: what ``DDP_MPI_IMPL`` may say
IMPL_CHOICES = ("auto", "cxx", "python")
#: the ABI the source is compiled for (``mpi.h`` of MPICH)
SONAME = "libmpi.so.12"


def _launch_error(message: str, hint: str) -> Exception:
    # imported here: the image's build stage runs this file alone, before the project is copied
    from launcher.core.errors import LaunchError

    return LaunchError(message, hint)


def module_name() -> str:
    """The module's name: a hash of what makes a build usable (source, torch)."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES)
                            + torch.__version__.encode()).hexdigest()
    return f"{_PREFIX}{digest[:16]}"


def built_path(directory: str | None = None) -> Path:
    return ext_files.directory(directory) / f"{module_name()}.so"


def build(mpi_prefix: Path, directory: str | None = None, quiet: bool = True) -> Path:
    """Compile the extension against ``mpi_prefix``'s MPICH into ``directory``
    (``ext_files.directory``) unless it is built already."""
    target = built_path(directory)
    if target.exists():
        return target
    include, lib = mpi_prefix / "include", mpi_prefix / "lib"
    if not (include / "mpi.h").exists() or not (lib / SONAME).exists():
        raise _launch_error(f"no MPICH to build the mpi backend against in {mpi_prefix} "
                          f"(needs include/mpi.h and lib/{SONAME})",
                          "pip install mpich (the project's [mpich] extra), or pass --mpi-prefix")
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    name = module_name()
    with ext_files.staging(target) as tmp:
        extension = CppExtension(
            name, [str(SOURCES[0])], include_dirs=[str(include)], library_dirs=[str(lib)],
            libraries=[":" + SONAME], extra_link_args=[f"-Wl,-rpath,{lib}"],
            extra_compile_args=["-O2", "-g0"])
        args = ["build_ext", "--build-lib", str(tmp), "--build-temp", str(tmp)]
        dist = Distribution({"name": name, "ext_modules": [extension], "script_args": args,
                             # no ninja needed: the image's build stage has none
                             "cmdclass": {"build_ext": BuildExtension.with_options(
                                 use_ninja=False)}})
        dist.verbose = 0 if quiet else 1
        dist.parse_command_line()
        dist.run_commands()
        (built,) = tmp.glob(f"{name}*.so")
        manifest = {"torch": torch.__version__, "libmpi": str((lib / SONAME).resolve())}
        built.with_suffix(".json").write_text(json.dumps(manifest))
        ext_files.install(built, target, _PREFIX, companions=(".json",))
    return target


def loaded_libmpi() -> str | None:
    """The path of the libmpi this process has mapped (mpi4py's), if any."""
    from launcher.mpi.library import mapped  # here: the build stage runs this file alone

    found = mapped()
    return found[0] if found else None


def _why_not_built(directory: str | None) -> str:
    others = sorted(ext_files.directory(directory).glob(f"{_PREFIX}*.json"))
    for other in others:
        version = json.loads(other.read_text()).get("torch")
        if version != torch.__version__:
            return f"the compiled mpi backend was built for torch {version}, this is " \
                   f"{torch.__version__} (rebuild: python -m launcher.mpi.cxx)"
    if others:
        return "the compiled mpi backend was built from another source (rebuild: " \
               "python -m launcher.mpi.cxx)"
    return f"the compiled mpi backend is not built in {ext_files.directory(directory)} " \
           "(./scripts/bootstrap.sh " \
           "or python -m launcher.mpi.cxx builds it)"


@dataclass(frozen=True)
class Choice:
    """The implementation of ``--backend mpi`` a rank runs, and why."""

    #: the registered backend name: ``mpi_cxx`` or ``mpi4py``
    name: str
    #: one line for launcher.check: which implementation, and why the fallback if it is one
    reason: str


# the compiled module once loaded: an extension is loaded once per process, and torch calls
# the backend registered from it (``register``) with its options alone; read only here
_module: ModuleType | None = None


def _load(directory: str | None) -> tuple[ModuleType | None, str]:
    """The compiled module in ``directory``, or None and why it cannot run here. Needs MPI
    started."""
    global _module
    if _module is not None:
        return _module, ""
    from mpi4py import MPI

    path = built_path(directory)
    if not path.exists():
        return None, _why_not_built(directory)
    libmpi = loaded_libmpi()
    if libmpi is None or not Path(libmpi).name.startswith(SONAME):
        return None, f"mpi4py runs on {libmpi or 'an unknown libmpi'}, the compiled mpi " \
                     f"backend on the MPICH ABI ({SONAME}): two MPI libraries cannot share a " \
                     "process"
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None, "MPI runs without MPI_THREAD_MULTIPLE, which the compiled backend's " \
                     "progress thread needs"
    spec = importlib.util.spec_from_file_location(module_name(), path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:  # e.g. a torch whose symbols changed under the same version
        return None, f"the compiled mpi backend does not load: {error}"
    if torch.__version__.split("+")[0] != module.TORCH_VERSION:
        return None, f"the compiled mpi backend is for torch {module.TORCH_VERSION}, this is " \
                     f"{torch.__version__}"
    if module.library_version() != MPI.Get_library_version():
        return None, "the compiled mpi backend and mpi4py see different MPI libraries"
    module.use_native_half(MPI.Get_library_version().startswith("MPICH Version:"))
    _module = module
    return module, ""


def loaded() -> ModuleType | None:
    """The compiled module once ``choose`` loaded it."""
    return _module


def choose(request: str = "auto", directory: str | None = None) -> Choice:
    """Register the implementation ``request`` (``JobEnv.mpi_impl``) asks for, the compiled one
    from ``directory`` (``JobEnv.mpi_cxx_dir``); MPI started."""
    from launcher.mpi import backend as mpi_backend

    if request not in IMPL_CHOICES:
        raise _launch_error(f"DDP_MPI_IMPL={request!r} is not one of {', '.join(IMPL_CHOICES)}",
                          "unset DDP_MPI_IMPL (auto: the compiled backend where it runs)")
    if request == "python":
        return Choice(mpi_backend.register(), "the Python mpi backend (DDP_MPI_IMPL=python)")
    module, why = _load(directory)
    if module is None:
        if request == "cxx":
            raise _launch_error(why, "unset DDP_MPI_IMPL to fall back to the Python backend")
        return Choice(mpi_backend.register(), f"the Python mpi backend: {why}")
    register(module)
    return Choice(BACKEND_NAME, f"the compiled mpi backend ({module.__file__})")


def register(module: ModuleType) -> None:
    import torch.distributed as dist

    from launcher.mpi import backend as mpi_backend
    from launcher.mpi import waiting

    if BACKEND_NAME in dist.Backend.backend_list:
        return

    def create(opts, backend_options=None):
        comm = mpi_backend.communicator(opts)
        timeout_s = opts.timeout.total_seconds()
        rank = comm.rank

        def overdue(what: str, elapsed: float) -> None:
            mpi_backend.overdue(what, elapsed, timeout_s, rank)

        return module.create(comm.handle, rank, comm.size, timeout_s, waiting.spin_s(comm),
                             overdue)

    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                  devices=["cpu", "cuda"])


def _build_tools() -> tuple[str | None, str]:
    """DDP_MPI_CXX_DIR and CXX (directory, compiler), as ``launcher.placement.env`` reads them."""
    if not __package__:
        # run as a file of its own: the image's build stage, before the project is copied,
        # which sets neither variable: the defaults
        return None, "c++"
    from launcher.placement.env import build_tools

    tools = build_tools()
    return tools.mpi_cxx_dir, tools.compiler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.mpi.cxx",
                                     description="build the compiled mpi backend and the UCX "
                                     "address padding (launcher.mpi.ucx_address; cached)")
    parser.add_argument("--mpi-prefix", type=Path, default=Path(sys.prefix),
                        help="where MPICH's include/mpi.h and lib/libmpi.so.12 are")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    directory, compiler = _build_tools()
    if shutil.which(compiler) is None:
        raise SystemExit(f"launcher.mpi.cxx: error: no C++ compiler ({compiler})\n"
                         "HINT: apt-get install g++")
    # each apart: the padding is plain C++, which needs no torch headers nor MPICH's
    hints = [hint for hint in (
        _build_one("ucx_address", ucx_address.path(directory),
                   lambda: ucx_address.build(directory, compiler)),
        _build_one("mpi_cxx", built_path(directory),
                   lambda: build(args.mpi_prefix, directory, quiet=not args.verbose)),
    ) if hint]
    for hint in dict.fromkeys(hints):
        print(f"HINT: {hint}", file=sys.stderr)
    return 1 if hints else 0


def _build_one(name: str, target: Path, step) -> str | None:
    """``step()`` builds ``target``: one line that says what became of it; the HINT on
    failure."""
    fresh = not target.exists()
    try:
        step()
    except Exception as error:  # noqa: BLE001 -- the compiler's own messages are above
        why = getattr(error, "message", None) or str(error).splitlines()[0]
        print(f"launcher.mpi.cxx: error: {name} did not build: {why}", file=sys.stderr)
        return getattr(error, "hint", None) or (
            "the compiler's messages are above (more with --verbose); without the file, "
            "--backend mpi runs its Python implementation (mpi_cxx) and MPICH's UCX address "
            "goes unpadded (ucx_address)")
    print(f"{name}: {'built' if fresh else 'up to date'}: {target}", flush=True)
    return None


if __name__ == "__main__":
    sys.exit(main())
