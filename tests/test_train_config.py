"""The command line: every flag documented, bad values rejected with a hint."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from launcher.core.errors import LaunchError
from launcher.core.field_docs import field_docs
from launcher.training.config import TrainConfig, build_parser, parse_args
from tests.fixtures.mpi import REPO_ROOT, clean_environ


def test_every_field_has_a_docstring_and_a_flag():
    docs = field_docs(TrainConfig)
    help_text = build_parser().format_help()
    for field in dataclasses.fields(TrainConfig):
        assert len(docs.get(field.name, "")) > 10, field.name
        assert f"--{field.name.replace('_', '-')}" in help_text


def test_defaults():
    config = parse_args([])
    assert config == TrainConfig()
    assert config.per_rank_batch(2) == 32
    assert str(config.metrics_path) == "runs/train/metrics.jsonl"


def test_values_are_typed():
    config = parse_args(["--epochs", "2", "--lr", "0.5", "--run-dir", "/x", "--metrics", "m.j"])
    assert config.epochs == 2 and config.lr == 0.5
    assert str(config.checkpoint_dir) == "/x/checkpoints" and str(config.metrics_path) == "m.j"
    assert parse_args(["--deterministic"]).deterministic is True
    assert parse_args(["--deterministic", "--no-deterministic"]).deterministic is False


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--epochs", "two"], "invalid int value"),
    (["--precision", "fp8"], "--precision 'fp8' is not one of"),
    (["--sync", "async"], "--sync 'async' is not one of"),
    (["--backend", "ucx"], "--backend 'ucx' is not one of"),
    (["--dataset", "cifar"], "--dataset 'cifar' is not one of"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--dropout", "1"], "--dropout must be in"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--checkpoint-every", "-5"], "--checkpoint-every must be 0 or more"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_flags(argv, message):
    with pytest.raises(LaunchError, match=message) as info:
        parse_args(argv)
    assert info.value.hint


def test_batch_must_divide():
    config = parse_args(["--global-batch-size", "30", "--grad-accum", "2"])
    assert config.per_rank_batch(3) == 5
    with pytest.raises(LaunchError, match="does not divide into 4 ranks x 2") as info:
        config.per_rank_batch(4)
    assert "multiple of 8" in info.value.hint


def without_torch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python -m launcher.train ARGS`` with a torch that cannot be imported."""
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    env = clean_environ({"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"})
    return subprocess.run([sys.executable, "-m", "launcher.train", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_bad_flag_is_refused_before_torch_is_imported(tmp_path):
    """Every rank ends at once, not after the second or more that importing torch costs."""
    result = without_torch(tmp_path, "--lr", "-1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["[rank 0] error: --lr must be positive, got -1.0",
                                          "[rank 0] HINT: e.g. --lr 0.05"]


def test_help_answers_without_importing_torch(tmp_path):
    """`--help` in a fraction of a second: a torch that cannot be imported is never touched."""
    result = without_torch(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    assert "--metrics METRICS" in result.stdout
    assert "(default: None)" not in result.stdout  # what no value means is in the field's doc
    assert "(default RUN_DIR/metrics.jsonl)" in result.stdout
