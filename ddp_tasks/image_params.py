"""The image tasks' parameters (``base``, ``build``, ``push``, ``chimage``, ``lock``, ``sif``):
each default and each help text written once, as fields (``ddp_tasks.task_params``).

A task names its defaults as ``IMAGE.field`` and takes its help from ``documented(ImageParams)``;
what one task means differently from the others is a note in that task's module.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_tasks import flavors
from ddp_tasks import image_commands as ic


@dataclass(frozen=True)
class ImageParams:
    flavor: str = flavors.DEFAULT
    """the image's flavor: its tag is NAME:FLAVOR"""
    name: str = ic.DEFAULT_NAME
    """image name; the tag is NAME:FLAVOR"""
    base_image: str = ""
    """base image for both stages, e.g. ddp-base:bookworm from `invoke base` (default:
    debian:bookworm-slim)"""
    wheelhouse: str = ic.DEFAULT_WHEELHOUSE
    """directory of wheels for pip --find-links, e.g. the torch wheel; skipped where it is not
    named and does not exist"""
    ca_bundle: str = ""
    """full CA bundle pip trusts during the build, for TLS-intercepting proxies (default:
    $PIP_CERT); not kept in the image unless --keep-ca"""
    keep_ca: bool = False
    """keep the CA bundle in the image for pip in its venv (/opt/ddp/ca, venv pip.conf)"""
    build_args: str = ""
    """more build arguments, NAME=VALUE,NAME=VALUE (e.g. TORCH_FROM_SOURCE=1: PyTorch
    compiled with USE_MPI=1, hours)"""
    nocache: bool = False
    """ignore the build cache"""
    registry: str = ""
    """registry to push to, HOST[:PORT][/PATH] (default: $DDP_REGISTRY)"""
    image: str = ""
    """the engine's image to convert (default NAME:FLAVOR)"""
    dry_run: bool = False
    """print the command, run nothing"""
    tag: str = ic.DEFAULT_BASE_TAG
    """name:tag of the imported base image"""
    suite: str = ic.DEBIAN_SUITE
    """Debian release to bootstrap (its python3 must be the image's: bookworm's is 3.11)"""
    mirror: str = ic.DEBIAN_MIRROR
    """Debian mirror or a local proxy of it"""


IMAGE = ImageParams()
