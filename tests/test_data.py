"""IDX parsing, the MNIST loader's checks and the fixed digits split, on files the tests write."""

from __future__ import annotations

import gzip
import re
import struct
import sys

import numpy as np
import pytest
import torch

from launcher.core.errors import LaunchError
from launcher.training import data
from launcher.training.data import user_dataset


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file for a uint8 array, as the format (and MNIST) defines it."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(directory, n_train=6, n_test=4, gz=False):
    rng = np.random.default_rng(1)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": rng.integers(0, 10, n_train),
        "test_images": rng.integers(0, 256, (n_test, 28, 28)),
        "test_labels": rng.integers(0, 10, n_test),
    }
    for key, stem in data.MNIST_FILES.items():
        raw = idx_bytes(arrays[key])
        if gz:
            (directory / f"{stem}.gz").write_bytes(gzip.compress(raw))
        else:
            (directory / stem).write_bytes(raw)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_read_idx_round_trips(tmp_path, gz):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = idx_bytes(array)
    path = tmp_path / ("x.idx.gz" if gz else "x.idx")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    np.testing.assert_array_equal(data.read_idx(path), array)


def test_read_idx_big_endian_int32(tmp_path):
    values = np.array([1, -2, 70000], dtype=">i4")
    path = tmp_path / "ints.idx"
    path.write_bytes(bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 3) + values.tobytes())
    assert data.read_idx(path).tolist() == [1, -2, 70000]


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:-1], "promises"),
    (lambda raw: raw + b"\0", "promises"),
    (lambda raw: b"\x01" + raw[1:], "magic"),
    (lambda raw: raw[:2] + b"\x42" + raw[3:], "unknown IDX type"),
    (lambda raw: raw[:6], "truncated inside its header"),
], ids=["truncated", "trailing", "magic", "type", "header"])
def test_read_idx_rejects_damage(tmp_path, damage, message):
    path = tmp_path / "bad.idx"
    path.write_bytes(damage(idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8))))
    with pytest.raises(LaunchError, match=message) as info:
        data.read_idx(path)
    assert info.value.hint and "download it again" in info.value.hint


def test_read_idx_rejects_broken_gzip(tmp_path):
    path = tmp_path / "bad.idx.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((3, 2), dtype=np.uint8)))[:-8])
    with pytest.raises(LaunchError, match="cannot read"):
        data.read_idx(path)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_prepare_mnist_reads_all_four_files(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    prepared = data.prepare_mnist(tmp_path)
    for key, value in arrays.items():
        np.testing.assert_array_equal(prepared[key], value)
    assert prepared["train_labels"].dtype == np.int64


def test_prepare_mnist_names_the_missing_file(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(LaunchError, match="t10k-labels-idx1-ubyte") as info:
        data.prepare_mnist(tmp_path)
    assert "--data-dir" in info.value.hint


def test_prepare_mnist_rejects_mismatched_counts(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(5, dtype=np.uint8)))
    with pytest.raises(LaunchError, match="6 images but labels of shape"):
        data.prepare_mnist(tmp_path)


def test_prepare_mnist_rejects_wrong_image_shape(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(
        idx_bytes(np.zeros((4, 8, 8), dtype=np.uint8)))
    with pytest.raises(LaunchError, match=r"expected \[N, 28, 28\]"):
        data.prepare_mnist(tmp_path)


def test_digits_split_is_fixed_and_disjoint():
    first, second = data.prepare_digits(), data.prepare_digits()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])
    assert len(first["train_labels"]) + len(first["test_labels"]) == 1797
    assert len(first["test_labels"]) == round(1797 * data.DIGITS_TEST_FRACTION)
    assert first["train_images"].shape[1:] == (28, 28)
    order = data.digits_split_order(1797)
    assert sorted(order.tolist()) == list(range(1797))
    # the documented split: seed 0's permutation, test set first; pinned so it cannot drift
    assert order[:5].tolist() == [360, 1773, 1482, 600, 850]
    assert set(np.unique(first["test_labels"])) == set(range(10))


def test_cache_is_written_once_and_read_back(tmp_path):
    dataset = data.load_dataset("digits", tmp_path, local_rank=0)
    cache = tmp_path / "cache" / "digits-28x28-v1.pt"
    assert cache.is_file()
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temp files left
    assert dataset.train.inputs.shape == (1438, 1, 28, 28)
    assert dataset.train.inputs.min() >= 0.0 and dataset.train.inputs.max() <= 1.0
    again = data.load_dataset("digits", tmp_path, local_rank=1)  # reads the cache
    assert (again.test.targets == dataset.test.targets).all()


def test_corrupt_cache_is_a_clear_error(tmp_path):
    cache = tmp_path / "cache" / "digits-28x28-v1.pt"
    cache.parent.mkdir()
    cache.write_bytes(b"not a torch file")
    with pytest.raises(LaunchError, match="cannot read the digits cache") as info:
        data.load_dataset("digits", tmp_path, local_rank=0)
    assert f"delete {cache}" in info.value.hint


def test_synthetic_is_deterministic():
    a, b = data.synthetic_dataset(), data.synthetic_dataset()
    assert (a.train.inputs == b.train.inputs).all() and (a.test.targets == b.test.targets).all()
    assert len(set(a.train.targets.tolist())) > 1


def _factory(monkeypatch, made):
    module = type(sys)("userdata")
    module.make = lambda: made
    monkeypatch.setitem(sys.modules, "userdata", module)
    return "userdata:make"


def test_a_user_dataset_of_any_shape(monkeypatch):
    tokens = torch.randint(7, (10, 5))
    dataset = user_dataset(_factory(monkeypatch, ((tokens[:8], tokens[:8]),
                                                  (tokens[8:], tokens[8:]))))
    assert len(dataset.train) == 8 and len(dataset.test) == 2
    assert dataset.num_classes == int(tokens.max()) + 1 and not dataset.float_targets


@pytest.mark.parametrize("made, message", [
    (42, "returned int, not two (inputs, targets) pairs"),
    (((torch.zeros(3, 2), torch.zeros(2)), (torch.zeros(1, 2), torch.zeros(1))),
     "the train split has 3 inputs and 2 targets"),
    ((([1, 2], torch.zeros(2)), (torch.zeros(1, 2), torch.zeros(1))),
     "the train split holds list and Tensor, not tensors"),
])
def test_a_bad_user_dataset_says_what_is_wrong(monkeypatch, made, message):
    with pytest.raises(LaunchError, match=re.escape(message)) as info:
        user_dataset(_factory(monkeypatch, made))
    assert "((train_inputs, train_targets), (test_inputs, test_targets))" in info.value.hint
