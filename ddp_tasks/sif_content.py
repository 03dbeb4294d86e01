"""A SIF without Apptainer, as pure builders: the metadata Apptainer keeps inside the image, the
SIF's data objects, the mksquashfs and siftool command lines. ``ddp_tasks.sif_build`` runs
them.

Which part follows which source (docs/image.md, "A SIF without Apptainer"):

- ``/.singularity.d/``: directories, symlinks and action/env scripts as Apptainer's
  ``internal/pkg/build/sources/base_environment.go`` makes them; ``env/10-docker2singularity.sh``,
  ``labels.json`` and the OCI config as its Docker conversion writes them
  (``conveyorPacker_oci.go``: ``insertEnv``, ``insertOCILabels``, ``insertOCIConfig``);
  ``runscript``, ``test``, ``runscript.help``, ``env/90-environment.sh`` and ``Singularity``
  from the definition's sections.
- the data objects and their order: ``internal/pkg/build/assemblers/sif.go`` (``createSIF``): the
  definition, then the JSON objects sorted by name (``inspect-metadata.json``,
  ``oci-config.json``, as ``pkg/image`` and ``pkg/inspect`` name and shape them), then the primary
  system partition (squashfs, the image's architecture).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

SINGULARITY_D = ".singularity.d"
#: ``siftool add --datatype``: the SIF data object types (sylabs/sif's Datatype minus 0x4000)
DEFFILE, GENERIC_JSON, PARTITION = 1, 6, 4
#: ``--partfs 1``: squashfs; ``--parttype 2``: the primary system partition
FS_SQUASH, PART_PRIMSYS = 1, 2
#: ``--partarch``: Docker's architecture names to SIF's codes
ARCH_CODES = {"386": 1, "amd64": 2, "arm": 3, "arm64": 4, "ppc64": 5, "ppc64le": 6,
              "mips": 7, "mipsle": 8, "mips64": 9, "mips64le": 10, "s390x": 11, "riscv64": 12}
INSPECT_METADATA, OCI_CONFIG = "inspect-metadata.json", "oci-config.json"
#: the fields of Docker's image config that belong to an OCI image config
_OCI_CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir",
                    "Labels", "StopSignal")
#: mksquashfs' compressor: gzip is what every squashfs reader (kernel, squashfuse) has; level 6
#: instead of its default 9: 3.4 x faster for 0.7 % more bytes on the cpu image (measured here)
COMPRESSION = ("-comp", "gzip", "-Xcompression-level", "6")

_SOURCE_ALL_ENV = """\
for script in /.singularity.d/env/*.sh; do
    if [ -f "$script" ]; then
        . "$script"
    fi
done
"""
#: /.singularity.d/actions/*: each sources the environment scripts in order, then starts its
#: program; the names and behaviour are Apptainer's, the text is ours
ACTIONS = {
    "exec": f'#!/bin/sh\n\n{_SOURCE_ALL_ENV}\nexec "$@"\n',
    "run": f'#!/bin/sh\n\n{_SOURCE_ALL_ENV}\nif [ -x /.singularity.d/runscript ]; then\n'
           '    exec /.singularity.d/runscript "$@"\nfi\nexec /bin/sh "$@"\n',
    "shell": f'#!/bin/sh\n\n{_SOURCE_ALL_ENV}\nif [ -x /bin/bash ]; then\n'
             '    SHELL=/bin/bash PS1="Apptainer> "\n    export SHELL PS1\n'
             '    exec /bin/bash --norc "$@"\nfi\nexec /bin/sh "$@"\n',
    "start": f'#!/bin/sh\n\n# Apptainer\'s instance start: let PID 1 go on\nkill -CONT 1\n\n'
             f'{_SOURCE_ALL_ENV}\nif [ -x /.singularity.d/startscript ]; then\n'
             '    exec /.singularity.d/startscript\nfi\n',
    "test": f'#!/bin/sh\n\n{_SOURCE_ALL_ENV}\nif [ -x /.singularity.d/test ]; then\n'
            '    exec /.singularity.d/test "$@"\nfi\nexec /bin/sh -c true\n',
}
#: env scripts Apptainer's base environment always has (no SCIF apps here: no 95-apps.sh)
BASE_ENV = {
    "01-base.sh": "#!/bin/sh\n",
    "99-base.sh": '#!/bin/sh\n# Apptainer binds libraries into /.singularity.d/libs (e.g. --nv)\n'
                  'LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/.singularity.d/libs"\n'
                  'PS1="Apptainer> "\nexport LD_LIBRARY_PATH PS1\n',
    "99-runtimevars.sh": '#!/bin/sh\n# PATH from `apptainer exec --env PATH=...` or '
                         'APPTAINERENV_{PREPEND_,APPEND_,}PATH\n'
                         'if [ -n "${SING_USER_DEFINED_PREPEND_PATH:-}" ]; then\n'
                         '    PATH="$SING_USER_DEFINED_PREPEND_PATH:$PATH"\nfi\n'
                         'if [ -n "${SING_USER_DEFINED_APPEND_PATH:-}" ]; then\n'
                         '    PATH="$PATH:$SING_USER_DEFINED_APPEND_PATH"\nfi\n'
                         'if [ -n "${SING_USER_DEFINED_PATH:-}" ]; then\n'
                         '    PATH="$SING_USER_DEFINED_PATH"\nfi\n'
                         'unset SING_USER_DEFINED_PREPEND_PATH SING_USER_DEFINED_APPEND_PATH '
                         'SING_USER_DEFINED_PATH\nexport PATH\n',
}
#: symlinks at the root of the image, to the metadata (name: target)
ROOT_LINKS = {
    "apptainer": ".singularity.d/runscript",
    "singularity": ".singularity.d/runscript",
    ".run": ".singularity.d/actions/run",
    ".exec": ".singularity.d/actions/exec",
    ".test": ".singularity.d/actions/test",
    ".shell": ".singularity.d/actions/shell",
    "environment": ".singularity.d/env/90-environment.sh",
}
#: directories every Apptainer image has (mount points for its runtime)
ROOT_DIRS = ("dev", "proc", "sys", "tmp", "var/tmp", "root", "home", "etc",
             ".singularity.d/libs", ".singularity.d/actions", ".singularity.d/env")
#: files the runtime binds over; a ``docker export`` may hold the build container's copies
EMPTY_FILES = ("etc/hosts", "etc/resolv.conf")

_SECTION = re.compile(r"^%(\w+)\s*$", re.MULTILINE)
_SHELL_SPECIAL = re.compile(r'([\\"`$])')


@dataclass(frozen=True)
class Image:
    """What the SIF takes from the Docker image: ``docker inspect``'s fields."""

    tag: str
    id: str
    created: str  # RFC 3339, as Docker writes it
    architecture: str
    config: dict


def definition_sections(text: str) -> dict[str, str]:
    """``%name`` sections of a definition, each body with its common indentation removed."""
    parts = _SECTION.split(text)
    sections = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = body.strip("\n").splitlines()
        indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()),
                     default=0)
        sections[name] = "\n".join(line[indent:] for line in lines).rstrip() + "\n"
    return sections


def definition_labels(text: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in
                definition_sections(text).get("labels", "").splitlines() if line.strip())


def epoch(created: str) -> int:
    """Seconds since 1970 of Docker's ``Created`` (nanoseconds cut): every time in the
    partition, so the same image gives the same bytes."""
    stamp = re.sub(r"(\.\d+)?(Z|[+-]\d\d:\d\d)$", r"\2", created).replace("Z", "+00:00")
    return int(datetime.fromisoformat(stamp).timestamp())


def docker_env_script(env: list[str]) -> str:
    """``env/10-docker2singularity.sh``: the image's ENV the way Apptainer's Docker conversion
    restates it: PATH is the image's, every other variable keeps a value the host gives."""
    lines = ["#!/bin/sh"]
    for item in env:
        name, sep, value = item.partition("=")
        value = _SHELL_SPECIAL.sub(r"\\\1", value)
        if not sep:
            lines.append(f'export {name}="${{{name}:-}}"')
        elif name == "PATH":
            lines.append(f'export PATH="{value}"')
        else:
            lines.append(f'export {name}="${{{name}:-{value}}}"')
    return "\n".join(lines) + "\n"


def labels(image: Image, definition: str) -> dict[str, str]:
    """``labels.json``: the image's labels, the definition's on top, and where it came from."""
    sections = definition_sections(definition)
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)", definition, re.MULTILINE))
    return {
        **(image.config.get("Labels") or {}),
        **definition_labels(definition),
        "org.label-schema.schema-version": "1.0",
        "org.label-schema.build-date": datetime.fromtimestamp(epoch(image.created), timezone.utc)
        .strftime("%A_%-d_%B_%Y_%-H:%M:%S_UTC"),
        "org.label-schema.usage.singularity.deffile.bootstrap": header.get("Bootstrap", ""),
        "org.label-schema.usage.singularity.deffile.from": header.get("From", ""),
        "io.ddp.sif.source-image": image.id,
        "io.ddp.sif.source-tag": image.tag,
        "io.ddp.sif.builder": "invoke sif --builder native (mksquashfs, siftool)",
        **({"org.label-schema.usage": "/.singularity.d/runscript.help"}
           if "help" in sections else {}),
    }


def metadata_files(image: Image, definition: str) -> dict[str, str]:
    """Every file under ``/.singularity.d/`` (path relative to the root: text); all 0755
    except ``labels.json``, ``Singularity`` and ``runscript.help`` (0644)."""
    sections = definition_sections(definition)
    d = SINGULARITY_D
    files = {f"{d}/actions/{name}": text for name, text in ACTIONS.items()}
    files.update({f"{d}/env/{name}": text for name, text in BASE_ENV.items()})
    files[f"{d}/env/10-docker2singularity.sh"] = docker_env_script(restated_env(image))
    files[f"{d}/env/90-environment.sh"] = ("#!/bin/sh\n# Custom environment shell code should "
                                           "follow\n\n" + sections.get("environment", ""))
    files[f"{d}/runscript"] = "#!/bin/sh\n\n" + sections.get("runscript", "exec /bin/sh\n")
    files[f"{d}/startscript"] = "#!/bin/sh\n"
    if "test" in sections:
        files[f"{d}/test"] = "#!/bin/sh\n\n" + sections["test"]
    if "help" in sections:
        files[f"{d}/runscript.help"] = sections["help"]
    files[f"{d}/labels.json"] = json.dumps(labels(image, definition), indent="\t",
                                           sort_keys=True)
    files[f"{d}/Singularity"] = definition
    return files


def charliecloud_files(image: Image) -> dict[str, str]:
    """``/ch/environment``: the image's ENV as ``ch-convert`` writes it (``NAME=VALUE`` lines),
    which ``ch-run --set-env`` reads, so that one file serves Charliecloud too."""
    return {"ch/environment": "".join(f"{item}\n" for item in restated_env(image))}


def restated_env(image: Image) -> list[str]:
    """The image's ENV as the SIF restates it, with the source image's id in ``DDP_IMAGE``:
    ``launcher.check`` compares that value across ranks, so ranks started from SIFs of two
    different builds (same version, other bytes) are told apart."""
    return [f"{item} {image.id[:19]}" if item.startswith("DDP_IMAGE=") else item
            for item in image.config.get("Env") or []]


def file_mode(path: str) -> int:
    return 0o644 if path.endswith(("labels.json", "/Singularity", ".help", "/environment")) \
        else 0o755


def inspect_metadata(image: Image, definition: str) -> str:
    """``inspect-metadata.json``: what ``apptainer inspect`` shows (pkg/inspect's Metadata)."""
    files = metadata_files(image, definition)
    d = SINGULARITY_D
    environment = (f"{d}/env/10-docker2singularity.sh", f"{d}/env/90-environment.sh")
    attributes = {
        "environment": {f"/{path}": files[path] for path in environment},
        "labels": labels(image, definition),
        "runscript": files[f"{d}/runscript"],
        "test": files.get(f"{d}/test", ""),
        "helpfile": files.get(f"{d}/runscript.help", ""),
        "deffile": definition,
    }
    return json.dumps({"data": {"attributes": attributes}, "type": "container"},
                      separators=(",", ":"), sort_keys=False)


def oci_config(image: Image) -> str:
    """``oci-config.json``: the image's run configuration (Apptainer's ``insertOCIConfig``)."""
    return json.dumps({key: image.config[key] for key in _OCI_CONFIG_KEYS
                       if image.config.get(key)}, separators=(",", ":"), sort_keys=True)


def json_objects(image: Image, definition: str) -> dict[str, str]:
    """The SIF's JSON data objects by name, in the order Apptainer adds them (sorted)."""
    objects = {INSPECT_METADATA: inspect_metadata(image, definition),
               OCI_CONFIG: oci_config(image)}
    return dict(sorted(objects.items()))


def mksquashfs_command(root: str, output: str, seconds: int | str, as_root: bool) -> list[str]:
    """The system partition. Reproducible: one time for every inode and the superblock,
    mksquashfs' own sorted directory order, fixed compression, no xattrs (the extracted tree's
    may differ by host). Unprivileged, every file becomes root's (Apptainer's ``-all-root``)."""
    return ["mksquashfs", root, output, "-noappend", *COMPRESSION, "-no-xattrs",
            "-all-time", str(seconds), "-mkfs-time", str(seconds), "-quiet", "-no-progress",
            *([] if as_root else ["-all-root"])]


def siftool_commands(sif: str, definition: str, jsons: dict[str, str], partition: str,
                     architecture: str) -> list[list[str]]:
    """``siftool new`` and one ``add`` per data object: the definition, the JSON objects
    (``jsons``: name: file), the primary system partition."""
    if architecture not in ARCH_CODES:
        from launcher.core.errors import LaunchError

        raise LaunchError(f"the image's architecture {architecture!r} has no SIF code",
                          hint=f"build the image for one of: {', '.join(ARCH_CODES)}")
    commands = [["siftool", "new", sif],
                ["siftool", "add", sif, definition, "--datatype", str(DEFFILE), "--filename",
                 "Singularity"]]
    commands += [["siftool", "add", sif, path, "--datatype", str(GENERIC_JSON), "--filename",
                  name] for name, path in jsons.items()]
    commands.append(["siftool", "add", sif, partition, "--datatype", str(PARTITION),
                     "--partfs", str(FS_SQUASH), "--parttype", str(PART_PRIMSYS),
                     "--partarch", str(ARCH_CODES[architecture])])
    return commands
