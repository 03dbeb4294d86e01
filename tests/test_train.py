"""``python -m launcher.train`` for real: the default run, preemption of one rank, resumes.

mpiexec, several ranks, real signals, real files (tests/fixtures/training.py runs them). The
sync modes compared: test_train_sync.py; models, datasets and bad input: test_train_models.py;
GPUs: test_train_gpu.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.api import checkpoint
from launcher.core.errors import EXIT_USER_ERROR
from tests.fixtures.mpi import clean_environ
from tests.fixtures.training import (
    BACKENDS,
    HASH,
    RESUME_FLAGS,
    STEPS_PER_EPOCH,
    metrics,
    preempt_rank_1,
    resumed_and_whole,
    start_training,
    the_hash,
    train,
)

pytestmark = pytest.mark.mpi

_references: dict[str, str] = {}


def reference_hash(backend: str, data_dir: Path, tmp_path_factory) -> str:
    """The parameters after an uninterrupted run with RESUME_FLAGS (computed once per backend
    and worker: the tests that read it share an xdist group, so once in all)."""
    if backend not in _references:
        run_dir = tmp_path_factory.mktemp(f"reference-{backend}")
        result = train(2, run_dir, data_dir, *RESUME_FLAGS, backend=backend)
        assert result.returncode == 0, result.output
        _references[backend] = the_hash(result)
    return _references[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_run_reaches_the_documented_accuracy(tmp_path, data_dir, backend):
    result = train(2, tmp_path, data_dir, backend=backend)
    assert result.returncode == 0, result.output
    the_hash(result)
    evals = metrics(tmp_path, "eval")
    assert len(evals) == 10
    assert evals[-1]["test_accuracy"] >= 0.95, evals[-1]  # the bar in docs/training.md
    steps = metrics(tmp_path, "step")
    assert steps[-1]["step"] == 220 and all(s["samples_per_s"] > 0 for s in steps)
    assert (tmp_path / "checkpoints" / "ckpt-00000220.pt").is_file()
    assert "Traceback" not in result.stderr


@pytest.mark.xdist_group("train-reference")
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigusr1_to_one_rank_then_resume_is_bit_exact(tmp_path, data_dir, backend,
                                                      tmp_path_factory):
    expected = reference_hash(backend, data_dir, tmp_path_factory)
    process = start_training(tmp_path, data_dir, backend)
    # a few steps into the second epoch: the stop lands mid-epoch, before its 89 steps end
    stdout, stderr = preempt_rank_1(process, tmp_path, STEPS_PER_EPOCH + 3)
    assert not HASH.search(stdout)
    saved = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert len(saved) == 1
    for rank in (0, 1):
        assert f"[rank {rank}] preempted, {saved[0]} saved: exit 75" in stderr, stderr
    state = checkpoint.load(saved[0])
    assert state["epoch"] == 1 and 0 < state["batch"] < STEPS_PER_EPOCH, (state["epoch"],
                                                                          state["batch"])
    assert len(state["rng"]) == 2 and not torch.equal(state["rng"][0]["torch"],
                                                      state["rng"][1]["torch"])

    resumed = train(2, tmp_path, data_dir, *RESUME_FLAGS, "--resume", "auto", backend=backend)
    assert resumed.returncode == 0, resumed.output
    assert f"resuming from {saved[0]}" in resumed.stdout
    assert the_hash(resumed) == expected


@pytest.mark.xdist_group("train-reference")
def test_corrupt_newest_checkpoint_is_skipped_and_resume_stays_exact(tmp_path, data_dir,
                                                                     tmp_path_factory):
    expected = reference_hash("gloo", data_dir, tmp_path_factory)
    first = train(2, tmp_path, data_dir, *RESUME_FLAGS, "--max-steps", "30",
                  "--checkpoint-every", "10")
    assert first.returncode == 0, first.output
    directory = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(directory)] == [
        "ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000030.pt"]
    newest = directory / "ckpt-00000030.pt"
    newest.write_bytes(newest.read_bytes()[:-1000])  # a writer cut off by a crash, say

    resumed = train(2, tmp_path, data_dir, *RESUME_FLAGS)  # --resume auto is the default
    assert resumed.returncode == 0, resumed.output
    assert "skipping checkpoint" in resumed.stderr and "ckpt-00000030.pt" in resumed.stderr
    assert "resuming from" in resumed.stdout and "(step 20, epoch 0, batch 20)" in resumed.stdout
    assert the_hash(resumed) == expected

    again = train(2, tmp_path, data_dir, *RESUME_FLAGS)  # a requeue after the end: nothing to do
    assert again.returncode == 0, again.output
    assert "training already complete at step 178" in again.stdout
    assert the_hash(again) == expected


@pytest.mark.parametrize("flags", [
    pytest.param([], id="mlp"),
    pytest.param(["--model", "cnn", "--grad-accum", "2"], id="cnn-accum"),  # buffers, no_sync
])
def test_resume_with_three_ranks_is_bit_exact(tmp_path, data_dir, flags):
    """An all-reduce over 3 ranks rounds by bucket layout, which DDP changes after its first
    backward: the first step after a resume must reduce like the uninterrupted run's."""
    flags = ["--global-batch-size", "48", "--epochs", "1", "--log-every", "100", *flags]
    second, whole = resumed_and_whole(3, tmp_path, data_dir, flags, stop_at=5)
    assert "step 5," in second.stdout, second.output
    assert the_hash(second, ranks=3) == the_hash(whole, ranks=3)


def test_resume_with_other_settings_or_a_batch_that_cannot_divide_is_refused(tmp_path,
                                                                             data_dir):
    first = train(1, tmp_path, data_dir, "--max-steps", "2", "--epochs", "1")
    assert first.returncode == 0, first.output
    second = train(3, tmp_path, data_dir, "--epochs", "1")  # 64 samples do not split in 3
    assert second.returncode == EXIT_USER_ERROR, second.output
    for rank in (0, 1, 2):
        assert f"[rank {rank}] error: " in second.stderr, second.output
        assert f"[rank {rank}] HINT: " in second.stderr, second.output
    assert ("continues a run of global batch 64 (written by 1 ranks), which does not divide "
            "into 3 ranks x 1 micro-batches") in second.stderr, second.output
    assert "HINT: resume it on a number of ranks that divides the batch: 1, 2, 4, 8" in (
        second.stderr)
    third = train(1, tmp_path, data_dir, "--epochs", "1", "--lr", "0.2")
    assert third.returncode == EXIT_USER_ERROR, third.output
    assert "belongs to a run with other settings: --lr 0.1 (now 0.2)" in third.stderr
    assert "HINT: resume with the same flags" in third.stderr



def test_the_already_complete_hint_followed_literally_trains_again(tmp_path, data_dir):
    def once(run_dir: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir",
             str(data_dir), "--epochs", "1"],
            capture_output=True, text=True, env=clean_environ(), cwd=tmp_path, timeout=240)

    assert once(tmp_path / "run").returncode == 0
    again = once(tmp_path / "run")
    assert again.returncode == 0, again.stderr
    said = re.search(r"training already complete at step \d+: nothing to do \(to train again: "
                     r"a new --run-dir, or remove (\S+)\)", again.stdout)
    assert said, again.stdout
    shutil.rmtree(tmp_path / said.group(1))  # relative to where it ran
    for run_dir in (tmp_path / "run", tmp_path / "new"):
        trained = once(run_dir)
        assert trained.returncode == 0, trained.stderr
        assert "starting from scratch" in trained.stdout and "param-sha256" in trained.stdout
