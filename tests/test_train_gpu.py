"""Training on GPUs (skipped without one; `pytest -m gpu tests/test_train_gpu.py` on a GPU
machine): every backend on CUDA tensors, resumes bit-exact, SyncBatchNorm."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.gpu import GPUS, nccl_ranks, needs_gpu
from tests.fixtures.training import (
    RESUME_FLAGS,
    differences,
    metrics,
    resumed_and_whole,
    saved_model,
    saved_state,
    the_hash,
    train,
)

pytestmark = pytest.mark.mpi

#: every backend on CUDA tensors; two ranks share one GPU when there is only one (gloo and the
#: mpi4py backend allow that, NCCL does not)
GPU_RUNS = [("nccl", nccl_ranks()), ("gloo", 2), ("mpi", 2)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend, ranks", GPU_RUNS)
def test_default_run_on_gpu_reaches_the_documented_accuracy(tmp_path, data_dir, backend, ranks):
    result = train(ranks, tmp_path, data_dir, backend=backend)
    assert result.returncode == 0, result.output
    assert "device cuda" in result.stdout, result.output
    the_hash(result, ranks)
    assert metrics(tmp_path, "eval")[-1]["test_accuracy"] >= 0.95


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_on_gpu_is_bit_exact(tmp_path, data_dir, precision):
    """Dropout draws from each rank's CUDA generator and fp16 steps depend on the GradScaler's
    scale: both must come back from the checkpoint for the resumed run to match."""
    flags = [*RESUME_FLAGS, "--precision", precision]
    second, whole = resumed_and_whole(2, tmp_path, data_dir, flags, stop_at=100, backend="mpi")
    assert the_hash(second) == the_hash(whole)
    state = saved_state(tmp_path / "resumed", 100)
    assert all("cuda" in rng for rng in state["rng"]), state["rng"]
    assert not torch.equal(state["rng"][0]["cuda"], state["rng"][1]["cuda"])
    assert ("scale" in state["scaler"]) == (precision == "fp16"), state["scaler"]


@pytest.mark.gpu
@needs_gpu
def test_deterministic_cnn_resume_on_gpu_is_bit_exact(tmp_path, data_dir):
    """Convolutions on GPU are bit-reproducible only with --deterministic (without it, two
    identical runs differed by 2 % relative after 20 steps on an H100)."""
    flags = ["--model", "cnn", "--deterministic", "--global-batch-size", "32", "--epochs", "1",
             "--checkpoint-every", "0", "--max-steps", "30"]
    second, whole = resumed_and_whole(2, tmp_path, data_dir, flags, stop_at=12, backend="mpi")
    assert the_hash(second) == the_hash(whole)


@pytest.mark.gpu
@needs_gpu
def test_sync_batch_norm_on_gpu_makes_two_ranks_match_one(tmp_path, data_dir):
    """With SyncBatchNorm two ranks of half the batch normalise over the whole batch, as one
    rank does. Compared after one step: later steps amplify rounding differences (measured:
    6e-6 after one step; each rank normalising its own half instead, as on CPU: 1e-3)."""
    flags = ["--model", "cnn", "--deterministic", "--dropout", "0", "--epochs", "1",
             "--global-batch-size", "32", "--max-steps", "1", "--checkpoint-every", "0"]
    backend = "nccl" if GPUS >= 2 else "mpi"
    two = train(2, tmp_path / "two", data_dir, *flags, backend=backend)
    one = train(1, tmp_path / "one", data_dir, *flags, backend="nccl")
    for result in (two, one):
        assert result.returncode == 0, result.output
    a, b = saved_model(tmp_path / "two", 1), saved_model(tmp_path / "one", 1)
    assert any("running_mean" in k for k in a), sorted(a)
    worst = differences(a, b)
    assert max(worst.values()) < 1e-4, worst

