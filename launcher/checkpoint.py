"""Checkpoint files: atomic writes, self-checking contents, finding the newest valid one.

File layout (``ckpt-<step:08d>.pt``)::

    8 bytes   magic  b"DDPCKPT1"
    32 bytes  SHA-256 of the payload
    8 bytes   payload length, little-endian
    payload   torch.save() of a dict of tensors and plain values (loaded with weights_only)

A file that is truncated, or altered anywhere, fails the length or checksum test and is never
loaded. Files are written under a temporary name in the same directory, fsynced, renamed and the
directory fsynced, so a reader sees either no file or the whole file. Only rank 0 writes.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import struct
from pathlib import Path

import numpy as np
import torch

from launcher.atomic import write_atomic
from launcher.errors import LaunchError

MAGIC = b"DDPCKPT1"
_HEADER = struct.Struct("<8s32sQ")
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CorruptCheckpoint(LaunchError):
    """A checkpoint file that is truncated, altered or not a checkpoint at all."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def encode(state: dict) -> bytes:
    """The file contents for ``state``: header, then the torch.save payload."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload


def decode(data: bytes, source: str, map_location: torch.device | str = "cpu") -> dict:
    """The state in ``data`` after checking magic, length and checksum."""
    hint = f"delete {source}, or resume from an older checkpoint (--resume PATH)"
    if len(data) < _HEADER.size:
        raise CorruptCheckpoint(f"{source} is truncated ({len(data)} bytes)", hint=hint)
    magic, digest, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{source} is not a launcher checkpoint (bad magic)", hint=hint)
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise CorruptCheckpoint(f"{source} is truncated: {len(payload)} of {length} payload bytes",
                                hint=hint)
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{source} fails its SHA-256 check (damaged)", hint=hint)
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def save(directory: Path, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and delete all but the newest ``keep``."""
    path = directory / checkpoint_name(step)
    write_atomic(path, encode(state))
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load(path: Path, map_location: torch.device | str = "cpu") -> dict:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LaunchError(f"cannot read checkpoint {path}: {exc.strerror}",
                          hint="every rank must see the run directory (a shared file system) "
                          "to resume; check --run-dir / --resume") from None
    return decode(data, str(path), map_location)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temporary files are never listed)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def newest_valid(directory: Path, warn) -> Path | None:
    """The newest checkpoint that passes its checks; ``warn(text)`` for each one skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            load(path)
        except LaunchError as exc:
            warn(f"skipping checkpoint {path}: {exc.message}")
            continue
        return path
    return None


# --- random number generator states ------------------------------------------------------------

def capture_rng(device: torch.device) -> dict:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].cpu().numpy().astype(np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"],
                         numpy_state["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
