"""Pure builders for the image tasks: command lines, build arguments, tags and pins.

Nothing here touches Docker or the disk, so tests compare the results exactly; the invoke
tasks in ``ddp_tasks.image`` only feed these into docker-py, debootstrap and apptainer.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
APPTAINER_DEF = ROOT / "apptainer" / "ddp.def"

#: the build inputs the Dockerfile copies from the context (git-ignored, never part of the runtime
#: image by default): ``wheelhouse/`` for ``pip --find-links`` and an optional CA bundle
BUILD_INPUTS = ".build-inputs"
CA_BUNDLE_NAME = "extra-ca.crt"
#: where ``pip download ... -d .wheelhouse`` puts wheels by default; the build links them in
DEFAULT_WHEELHOUSE = ".wheelhouse"

FLAVORS = ("cpu", "cuda")
DEFAULT_NAME = "ddp"
DEFAULT_BASE_TAG = "ddp-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SECURITY = "http://deb.debian.org/debian-security"
#: PyTorch's own index for the wheels of each flavor (PyPI's default Linux wheel is the CUDA one)
TORCH_INDEX = {
    "cpu": "https://download.pytorch.org/whl/cpu",
    "cuda": "https://download.pytorch.org/whl/cu128",
}
#: build arguments each flavor changes from the Dockerfile's defaults (which are the cpu ones);
#: cuda is documented, not buildable here: its base image needs a registry
FLAVOR_ARGS = {
    "cpu": {},
    "cuda": {
        "BASE_IMAGE": "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04",
        "PYTHON_VERSION": "3.12",
        "CUDA_VERSION": "12.8",
    },
}

_ARG_RE = re.compile(r'^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=("[^"]*"|\S*))?\s*$')
# files whose content decides the image: a change here means the image must be rebuilt
_SOURCE_GLOBS = ("docker/Dockerfile", ".dockerignore", "pyproject.toml", "launcher/**/*.py",
                 f"{BUILD_INPUTS}/**/*")


def dockerfile_args(text: str) -> dict[str, str]:
    """The ``ARG NAME=default`` pins of a Dockerfile, in order (the first definition wins)."""
    args: dict[str, str] = {}
    for line in text.splitlines():
        match = _ARG_RE.match(line.strip())
        if match and match.group(1) not in args:
            args[match.group(1)] = (match.group(2) or "").strip('"')
    return args


def pins() -> dict[str, str]:
    """The version pins at the top of docker/Dockerfile (the single source of truth)."""
    return dockerfile_args(DOCKERFILE.read_text())


def image_tag(name: str, flavor: str) -> str:
    """``NAME:FLAVOR``: the tag a build makes and a push sends (e.g. ``ddp:cpu``)."""
    check_flavor(flavor)
    return f"{name}:{flavor}"


def image_identity(name: str, version: str, flavor: str) -> str:
    """``NAME:VERSION+FLAVOR``: what ``DDP_IMAGE`` carries inside the image."""
    return f"{name}:{version}+{flavor}"


def check_flavor(flavor: str) -> None:
    if flavor not in FLAVORS:
        from launcher.errors import LaunchError

        raise LaunchError(f"unknown image flavor {flavor!r}",
                          hint=f"use one of: {', '.join(FLAVORS)}")


def build_args(*, flavor: str, identity: str, torch_index_url: str, source_digest: str,
               base_image: str = "", keep_ca: bool = False,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """``--build-arg`` values for docker/Dockerfile; ``extra`` overrides any of them."""
    check_flavor(flavor)
    args = {"FLAVOR": flavor, **FLAVOR_ARGS[flavor]}
    if base_image:
        args["BASE_IMAGE"] = base_image
    args.update({
        "DDP_IMAGE": identity,
        "TORCH_INDEX_URL": torch_index_url,
        "SOURCE_DIGEST": source_digest,
        "KEEP_EXTRA_CA": "1" if keep_ca else "0",
    })
    args.update(extra or {})
    return args


def parse_build_args(pairs: str) -> dict[str, str]:
    """``"A=1,B=2"`` from the command line into ``{"A": "1", "B": "2"}``."""
    result: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in pairs.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            from launcher.errors import LaunchError

            raise LaunchError(f"bad build argument {item!r}",
                              hint="write build arguments as NAME=VALUE,NAME=VALUE")
        result[key] = value
    return result


def torch_index_for(flavor: str, wheelhouse_has_torch: bool) -> str:
    """PyTorch's index for FLAVOR, or none when the wheelhouse already holds the torch wheel.

    An unreachable extra index costs minutes of pip retries on closed networks, so a wheelhouse
    with torch in it replaces the index instead of adding to it.
    """
    return "" if wheelhouse_has_torch else TORCH_INDEX[flavor]


def source_digest(root: Path = ROOT) -> str:
    """A short hash of the files that decide the image, so fixtures can reuse a current image."""
    digest = hashlib.sha256()
    for pattern in _SOURCE_GLOBS:
        for path in sorted(root.glob(pattern)):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def debootstrap_command(rootfs: str, suite: str = "bookworm",
                        mirror: str = DEBIAN_MIRROR) -> list[str]:
    """The minimal Debian root filesystem for ``invoke base`` (no registry needed)."""
    return ["debootstrap", "--variant=minbase", suite, rootfs, mirror]


def apt_sources(suite: str = "bookworm", mirror: str = DEBIAN_MIRROR,
                security: str = DEBIAN_SECURITY) -> str:
    """sources.list for the base image: debootstrap writes only the release itself, so the
    updates and security suites are added to keep ``apt-get upgrade`` meaningful."""
    return (f"deb {mirror} {suite} main\n"
            f"deb {mirror} {suite}-updates main\n"
            f"deb {security} {suite}-security main\n")


#: what Debian's official ``-slim`` images configure, so that a debootstrap base is as lean:
#: apt keeps no downloaded packages or caches, dpkg installs no docs, man pages or locales
BASE_IMAGE_FILES = {
    "etc/apt/apt.conf.d/docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'),
    "etc/apt/apt.conf.d/docker-no-languages": 'Acquire::Languages "none";\n',
    "etc/dpkg/dpkg.cfg.d/docker-slim": (
        "path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\n"
        "path-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n"
        "path-exclude /usr/share/locale/*\npath-include /usr/share/locale/locale.alias\n"),
}
#: what debootstrap already installed that the dpkg excludes above would have left out
BASE_IMAGE_PRUNE = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*/LC_MESSAGES")

#: Dockerfile instructions ``docker import`` applies: an imported tarball has no config at all
IMPORT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)


def push_reference(registry: str, name: str, flavor: str) -> tuple[str, str]:
    """``(repository, tag)`` for ``docker push``: ``REGISTRY/NAME`` and FLAVOR."""
    registry = registry.rstrip("/")
    repository = f"{registry}/{name}" if registry else name
    return repository, flavor


#: Apptainer's bootstrap agents for a Docker image: the local engine, a ``docker save`` tarball,
#: or a registry (``From:`` is then ``REGISTRY/NAME:TAG``)
SIF_SOURCES = ("docker-daemon", "docker-archive", "docker")
_HEADER_RE = re.compile(r"^(Bootstrap|From):.*$", re.MULTILINE)


def sif_definition(text: str, source: str, image: str) -> str:
    """The def file with its header pointed at IMAGE through the SOURCE bootstrap agent."""
    if source not in SIF_SOURCES:
        from launcher.errors import LaunchError

        raise LaunchError(f"unknown SIF source {source!r}",
                          hint=f"use one of: {', '.join(SIF_SOURCES)}")
    values = {"Bootstrap": source, "From": image}
    return _HEADER_RE.sub(lambda m: f"{m.group(1)}: {values[m.group(1)]}", text)


def sif_command(output: str, definition: str, executable: str = "apptainer",
                fakeroot: bool = False) -> list[str]:
    """``apptainer build [--fakeroot] OUTPUT DEFINITION``."""
    return [executable, "build", *(["--fakeroot"] if fakeroot else []), output, definition]


def chimage_command(image: str, output: str) -> list[str]:
    """``ch-convert -i docker IMAGE OUTPUT``: a Charliecloud directory image from the engine's
    image (a ``.sqfs`` OUTPUT makes a SquashFS file instead, which needs squashfuse to run)."""
    return ["ch-convert", "-i", "docker", image, output]
