"""Checkpoint files: plain ``torch.save`` dicts, self-checking, atomic, the newest valid one found.

A checkpoint (``ckpt-<step:08d>.pt``) is what ``torch.save`` writes: ``torch.load(path,
weights_only=True)`` reads it anywhere, with no launcher and any number of processes. The
launcher adds one key, ``"sha256"``: the SHA-256 of the rest of the contents (every tensor's
dtype, shape and bytes, every other value's type and repr, in order). ``load`` recomputes it, so a
file that is truncated, or altered in anything it holds, is never loaded; a byte that changes
nothing loaded (zip padding, say) is harmless.

``encode`` loads what it wrote back, the way ``load`` will, before anything is written: state
that would fail there (an ``argparse.Namespace``, a numpy array), or that pickle cannot save (a
lock, a lambda), is refused when saved, naming the key, not found after a preemption. Files are
written under a temporary name in the same directory, fsynced, renamed and the directory
fsynced, so a reader sees either no file or the whole file. Only rank 0 writes; a save also
removes the checkpoints of later steps, which belong to a timeline the run left by resuming
from an earlier one (``save``).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from launcher.core.atomic import write_atomic
from launcher.core.errors import LaunchError

#: the layout of the keys ``launcher.api.job`` and ``launcher.train`` write (docs/training.md)
FORMAT = 3
#: the formats this version resumes from: 2 held Python's random state as 625 ints
READABLE = (2, 3)
DIGEST_KEY = "sha256"
#: what pickle raises for a value it cannot save (a lock: TypeError; a lambda or a local
#: object: PicklingError or AttributeError); anything else raised while saving is a crash of
#: the value's own code (its __reduce__), a traceback and exit 70, as tests/test_fail_fast.py
_UNPICKLABLE = (pickle.PicklingError, TypeError, AttributeError)
#: 8 digits or more: ``checkpoint_name`` pads to 8 and writes step 10**8 with 9
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class CorruptCheckpoint(LaunchError):
    """A checkpoint file that is truncated, altered or not a checkpoint at all."""


class UnloadableState(LaunchError):
    """State that ``torch.load(weights_only=True)`` would refuse: refused before it is saved."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def content_digest(state: dict) -> str:
    """SHA-256 over everything in ``state`` but its digest (see the module docstring)."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != DIGEST_KEY})
    return digest.hexdigest()


def _feed(digest, value: object) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(f"{{{len(value)}".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        # torch.Size comes back as torch.Size, a tuple as a tuple: the kind is part of the digest
        digest.update(f"{'[' if isinstance(value, list) else '('}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def encode(state: dict) -> bytes:
    """The file contents for ``state`` (its digest added), checked to load back as resume loads
    them; an ``UnloadableState`` naming the first value that cannot be saved or loaded back."""
    buffer = io.BytesIO()
    try:
        torch.save({**state, DIGEST_KEY: content_digest(state)}, buffer)
    except _UNPICKLABLE as exc:  # a lock, a lambda; another error is a crash of the values' own
        raise _refused(state, f"cannot be saved by torch.save ({_said(exc)})") from None
    data = buffer.getvalue()
    try:
        decode(data, "the state")
    except CorruptCheckpoint:
        raise _refused(state, "cannot be loaded back with torch.load(weights_only=True), so "
                       "resume would fail") from None
    return data


def _refused(state: dict, why: str) -> UnloadableState:
    return UnloadableState(f"job.save: {_first_unloadable('state', state)} {why}",
                           hint="save tensors, numbers, strings, lists, tuples and dicts only: "
                           "vars(args) for an argparse.Namespace, torch.from_numpy(a) or "
                           "a.tolist() for a numpy array, .item() for a numpy scalar")


def _first_unloadable(where: str, value: object) -> str:
    """The deepest key path in ``value`` whose own round trip fails, with its type."""
    children = (value.items() if isinstance(value, dict) else
                enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in children:
        if not _round_trips(item):
            return _first_unloadable(f"{where}[{key!r}]", item)
    return f"{where} ({type(value).__module__}.{type(value).__qualname__})"


def _round_trips(value: object) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception:  # whatever saving or loading raises, as in encode and decode
        return False
    return True


def decode(data: bytes, source: str, map_location: torch.device | str = "cpu") -> dict:
    """The state in ``data`` after checking that it loads and matches its digest."""
    hint = f"delete {source}, or resume from an older checkpoint"
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # damaged bytes raise anything (AssertionError, struct.error...)
        raise CorruptCheckpoint(f"{source} is truncated, damaged or not a checkpoint "
                                f"({len(data)} bytes; torch.load: {_said(exc)})",
                                hint=hint) from None
    if not isinstance(state, dict) or DIGEST_KEY not in state:
        raise CorruptCheckpoint(f"{source} is not a launcher checkpoint (no {DIGEST_KEY!r} key)",
                                hint=hint)
    if content_digest(state) != state[DIGEST_KEY]:
        raise CorruptCheckpoint(f"{source} fails its SHA-256 check (damaged)", hint=hint)
    return state if torch.device(map_location).type == "cpu" else _to(state, map_location)


def _said(exc: Exception) -> str:
    # torch's own text goes on for lines about weights_only; its first sentence says it
    return (str(exc).strip() or type(exc).__name__).splitlines()[0].split(". ")[0]


def _to(value: object, device: torch.device | str) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def save(directory: Path, step: int, state: dict, keep: int,
         warn: Callable[[str], None] = print) -> Path:
    """Write ``state`` as the checkpoint of ``step``, then delete the checkpoints of later steps
    (``warn(text)`` names them) and all but the newest ``keep`` of the rest, never this one.

    A later step's checkpoint belongs to a timeline the run left: it resumed from an earlier
    one (``--resume PATH``, or a newer one damaged). Kept, it would outrank this run's own in
    ``newest_valid`` (the next ``--resume auto`` would go back to the abandoned timeline), and
    count against ``keep``, pruning this run's newest instead."""
    path = directory / checkpoint_name(step)
    write_atomic(path, encode(state))
    found = list_checkpoints(directory)
    left = [p for p in found if _step_of(p) > step]
    for stale in left:
        stale.unlink(missing_ok=True)
    if left:
        dropped = ", ".join(str(_step_of(p)) for p in left)
        warn(f"removed the checkpoints of later steps ({dropped}) from {directory}: step {step} "
             "was just saved, and they belong to the timeline this run left by resuming from an "
             "earlier step")
    for old in found[:len(found) - len(left)][:-keep]:
        old.unlink(missing_ok=True)
    return path


def load(path: str | Path, map_location: torch.device | str = "cpu") -> dict:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LaunchError(f"cannot read checkpoint {path}: {exc.strerror}",
                          hint="every rank must see the checkpoint (a shared file system); "
                          "check the path") from None
    return decode(data, str(path), map_location)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temporary files are never listed)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), key=_step_of)


def _step_of(path: Path) -> int:
    """The step of a checkpoint file ``list_checkpoints`` listed."""
    return int(_NAME.match(path.name).group(1))


def newest_valid(directory: Path, warn: Callable[[str], None]) -> Path | None:
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
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        # one tensor, not 625 ints: the digest feeds a tensor's bytes at once, an int at a time
        # (2,000 ranks' states: 0.4 s against 3.7)
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
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
    if isinstance(internal, torch.Tensor):  # format 3; format 2 held the tuple of ints
        internal = internal.tolist()
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def reseed_rng(saved: list[dict], rank: int, world_size: int, device: torch.device) -> None:
    """New RNG streams for ``rank`` of ``world_size`` when the checkpoint's ``saved`` states
    belong to another world size: seeded from rank 0's saved torch state, the rank and the size,
    so two resumes on the same number of ranks draw the same numbers."""
    digest = hashlib.sha256(saved[0]["torch"].cpu().numpy().tobytes())
    digest.update(f"{rank}/{world_size}".encode())
    seed = int.from_bytes(digest.digest()[:8], "little") >> 1
    torch.manual_seed(seed)  # CUDA generators too
    np.random.seed(seed % 2**32)
    random.seed(seed)
