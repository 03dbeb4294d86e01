"""Datasets as in-memory tensors: scikit-learn's digits, MNIST from IDX files, synthetic, or a
user's own ``package.module:factory``.

The built-in datasets end up as images ``[N, 1, 28, 28]`` and ``int64`` labels, split into
train and test. A user's factory returns ``((train_inputs, train_targets), (test_inputs,
test_targets))``: tensors of any shape whose first dimension counts the samples (integer
targets are classes, float targets values to regress).

Preparing a built-in one (decompressing, resizing) happens once per node, on local rank 0,
which writes a cache file atomically; the other ranks of the node wait for it (the collective
of ``launcher.faults.agreement.agree`` doubles as the barrier) and then read the cache.
An error on any rank (a missing or corrupt file on one node's local disk) reaches every rank
before the next collective, so nobody is left waiting.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from launcher.core.atomic import write_atomic
from launcher.core.errors import LaunchError
from launcher.faults.agreement import agree
from launcher.training.config import DATASETS
from launcher.training.factories import load_factory

IMAGE_SIZE = 28
NUM_CLASSES = 10

#: the digits split is fixed, whatever --seed says, so that test accuracy is comparable
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2

#: MNIST file stems; each may be raw or gzip-compressed (``.gz``)
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

SYNTHETIC_TRAIN, SYNTHETIC_TEST = 8192, 1024

#: IDX type codes (the third header byte) -> numpy dtype, big-endian as the format says
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass(frozen=True)
class Split:
    """One split: ``inputs[i]`` and ``targets[i]`` are sample i (built-in datasets: images
    ``[N, 1, 28, 28]`` float32 in [0, 1] and labels ``[N]`` int64)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.targets)


@dataclass(frozen=True)
class Dataset:
    """Train and test splits of one dataset."""

    name: str
    train: Split
    test: Split
    #: classes of integer targets (0 .. num_classes-1); unused for float targets
    num_classes: int = NUM_CLASSES

    @property
    def float_targets(self) -> bool:
        return self.train.targets.is_floating_point()


def load_dataset(name: str, data_dir: Path, local_rank: int) -> Dataset:
    """Collective: local rank 0 of each node prepares the cache, then every rank loads it."""
    if name == "synthetic":
        return synthetic_dataset()
    if ":" in name:
        with agree():
            return user_dataset(name)
    cache = data_dir / "cache" / f"{name}-{IMAGE_SIZE}x{IMAGE_SIZE}-v1.pt"
    with agree():
        if local_rank == 0 and not cache.exists():
            _write_cache(cache, _prepare(name, data_dir))
    with agree():
        return _read_cache(name, cache)


# --- preparation (local rank 0 only) ---------------------------------------------------------

def _prepare(name: str, data_dir: Path) -> dict[str, np.ndarray]:
    if name == "digits":
        return prepare_digits()
    if name == "mnist":
        return prepare_mnist(data_dir)
    raise LaunchError(f"unknown dataset {name!r}", hint=f"use one of: {', '.join(DATASETS)}")


def prepare_digits() -> dict[str, np.ndarray]:
    """scikit-learn's 1797 8x8 digits, resized to 28x28 (bilinear), split 80/20 with seed 0."""
    path = _digits_csv()
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    small = torch.from_numpy(pixels / 16.0).reshape(-1, 1, 8, 8)
    large = F.interpolate(small, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                          align_corners=False)
    images = (large.clamp(0, 1) * 255).round().to(torch.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
    order = digits_split_order(len(labels))
    n_test = round(len(labels) * DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return {
        "train_images": images.numpy()[train], "train_labels": labels[train],
        "test_images": images.numpy()[test], "test_labels": labels[test],
    }


def digits_split_order(n: int) -> np.ndarray:
    """The fixed permutation behind the digits split: the first 20 % are the test set."""
    return np.random.default_rng(DIGITS_SPLIT_SEED).permutation(n)


def _digits_csv() -> Path:
    # find_spec does not import scikit-learn (slow); the CSV ships inside the package
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("the digits dataset needs scikit-learn, which is not installed",
                          hint="pip install scikit-learn, or use --dataset mnist|synthetic")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    if not path.is_file():
        raise LaunchError(f"scikit-learn has no digits data at {path}",
                          hint="reinstall scikit-learn (pip install --force-reinstall "
                          "scikit-learn)")
    return path


def prepare_mnist(data_dir: Path) -> dict[str, np.ndarray]:
    """The four MNIST IDX files from ``data_dir``, raw or ``.gz``, checked against each other."""
    arrays = {key: read_idx(_find_mnist_file(data_dir, stem)) for key, stem in MNIST_FILES.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise LaunchError(f"MNIST {split} images have shape {images.shape}, expected "
                              f"[N, {IMAGE_SIZE}, {IMAGE_SIZE}]",
                              hint=f"check the files in {data_dir} (not MNIST-format images?)")
        if labels.ndim != 1 or len(labels) != len(images):
            raise LaunchError(f"MNIST {split}: {len(images)} images but labels of shape "
                              f"{labels.shape}",
                              hint=f"the image and label files in {data_dir} do not belong "
                              "together; download both again")
        if images.dtype != np.uint8 or labels.size and labels.max() >= NUM_CLASSES:
            raise LaunchError(f"MNIST {split} files hold {images.dtype} images / labels up to "
                              f"{labels.max()}, expected uint8 images and labels 0-9",
                              hint=f"check the files in {data_dir}")
        arrays[f"{split}_labels"] = labels.astype(np.int64)
    return arrays


def _find_mnist_file(data_dir: Path, stem: str) -> Path:
    for candidate in (data_dir / stem, data_dir / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise LaunchError(f"MNIST file {stem}[.gz] not found in {data_dir}",
                      hint=f"put the four MNIST IDX files ({', '.join(MNIST_FILES.values())}, "
                      "raw or .gz) into --data-dir, or use --dataset digits")


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (raw or gzip); any inconsistency is a LaunchError naming the file."""
    hint = f"the file is damaged or not an IDX file: download it again ({path})"
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise LaunchError(f"cannot read {path}: {exc}", hint=hint) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise LaunchError(f"{path} has no IDX magic number", hint=hint)
    dtype, ndim = _IDX_DTYPES.get(raw[2]), raw[3]
    if dtype is None or ndim == 0:
        raise LaunchError(f"{path} has an unknown IDX type 0x{raw[2]:02x} or no dimensions",
                          hint=hint)
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise LaunchError(f"{path} is truncated inside its header", hint=hint)
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise LaunchError(f"{path} holds {len(raw)} bytes, but its header (shape {shape}) "
                          f"promises {expected}", hint=hint)
    values = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="))


# --- the cache ---------------------------------------------------------------------------------

def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    # atomic, so two nodes sharing the directory both leave one complete (identical) file
    try:
        write_atomic(path, buffer.getvalue())
    except OSError as exc:
        raise LaunchError(f"cannot write the dataset cache {path}: {exc}",
                          hint="make --data-dir writable (local rank 0 of each node writes "
                          "DATA_DIR/cache), or point --data-dir elsewhere") from None


def _read_cache(name: str, path: Path) -> Dataset:
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        return Dataset(name, _split(tensors, "train"), _split(tensors, "test"))
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        raise LaunchError(f"cannot read the {name} cache {path}: {exc}",
                          hint=f"delete {path}; the next run prepares it again") from None


def _split(tensors: dict[str, torch.Tensor], split: str) -> Split:
    images = tensors[f"{split}_images"].to(torch.float32).div_(255).unsqueeze(1)
    return Split(images, tensors[f"{split}_labels"])


def user_dataset(spec: str) -> Dataset:
    """What ``package.module:factory`` returns, checked (see the module docstring)."""
    made = load_factory(spec, "--dataset")()
    hint = ("the factory must return ((train_inputs, train_targets), (test_inputs, "
            "test_targets)): tensors whose first dimension counts the samples")
    try:
        (train_inputs, train_targets), (test_inputs, test_targets) = made
    except (TypeError, ValueError):
        raise LaunchError(f"--dataset {spec} returned {type(made).__name__}, not two "
                          "(inputs, targets) pairs", hint=hint) from None
    splits = []
    for split, inputs, targets in (("train", train_inputs, train_targets),
                                   ("test", test_inputs, test_targets)):
        if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
            raise LaunchError(f"--dataset {spec}: the {split} split holds "
                              f"{type(inputs).__name__} and {type(targets).__name__}, not "
                              "tensors", hint=hint)
        if len(inputs) != len(targets) or len(inputs) == 0:
            raise LaunchError(f"--dataset {spec}: the {split} split has {len(inputs)} inputs "
                              f"and {len(targets)} targets", hint=hint)
        splits.append(Split(inputs, targets))
    classes = 0 if splits[0].targets.is_floating_point() else int(
        max(splits[0].targets.max(), splits[1].targets.max())) + 1
    return Dataset(spec, splits[0], splits[1], classes)


def synthetic_dataset(seed: int = 0) -> Dataset:
    """Random images labelled by a fixed random linear teacher: learnable, and needs no files."""
    generator = torch.Generator().manual_seed(seed)
    n = SYNTHETIC_TRAIN + SYNTHETIC_TEST
    images = torch.rand(n, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    teacher = torch.randn(IMAGE_SIZE * IMAGE_SIZE, NUM_CLASSES, generator=generator)
    labels = (images.flatten(1) - 0.5).matmul(teacher).argmax(1)
    return Dataset("synthetic",
                   Split(images[:SYNTHETIC_TRAIN], labels[:SYNTHETIC_TRAIN]),
                   Split(images[SYNTHETIC_TRAIN:], labels[SYNTHETIC_TRAIN:]))
