"""Models, datasets and precisions beyond the default, and bad input: for real, on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.core.errors import EXIT_USER_ERROR
from tests.fixtures.mpi import run_mpi
from tests.fixtures.training import metrics, the_hash, train

pytestmark = pytest.mark.mpi

def _damaged_mnist(directory: Path) -> None:
    from tests.test_data import write_mnist

    directory.mkdir()
    write_mnist(directory)
    path = directory / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-5])


BAD_INPUTS = {
    "batch-does-not-divide": (["--global-batch-size", "63"], "does not divide into 2 ranks"),
    "unknown-model": (["--model", "resnet"], "unknown model 'resnet'"),
    "model-import-fails": (["--model", "nosuchpkg.models:make"], "cannot import 'nosuchpkg"),
    "model-wrong-classes": (["--model", "mymodels:seven"], "returns [2, 7]"),
    "mnist-missing": (["--dataset", "mnist", "--data-dir", "{tmp}/empty"],
                      "train-images-idx3-ubyte[.gz] not found"),
    "mnist-truncated": (["--dataset", "mnist", "--data-dir", "{tmp}/mnist"], "promises"),
    "fp16-on-cpu": (["--precision", "fp16"], "fp16 needs a GPU"),
    "resume-path-missing": (["--resume", "{tmp}/nope.pt"], "cannot read checkpoint"),
    "bad-flag": (["--epochs", "0"], "--epochs must be at least 1"),
    # every rank writes its own log there first: each one fails on its own, none waits
    "run-dir-under-a-file": (["--run-dir", "{tmp}/a-file/run"], "cannot write this rank's log"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_every_rank_with_a_hint(tmp_path, data_dir, user_models, case):
    flags, message = BAD_INPUTS[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("")
    _damaged_mnist(tmp_path / "mnist")
    flags = [f.format(tmp=tmp_path) for f in flags]
    run_dir = tmp_path / "run"
    args = ["-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir", str(data_dir),
            *flags]
    result = run_mpi(2, args, timeout=120, env=user_models)
    assert not result.timed_out, result.output
    assert result.returncode == EXIT_USER_ERROR, result.output
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.stderr, result.output
        assert f"[rank {rank}] HINT:" in result.stderr, result.output
    assert message in result.stderr, result.output
    assert "Traceback" not in result.stderr, result.output
    if case.startswith("mnist"):
        # only local rank 0 reads the files: rank 1 learns of the failure, it does not wait
        assert "[rank 1] error: rank 0 failed: " in result.stderr, result.output
    assert not list(run_dir.glob("checkpoints/*"))


def test_user_model_trains(tmp_path, data_dir, user_models):
    result = train(2, tmp_path / "run", data_dir, "--model", "mymodels:linear", "--epochs", "1",
                   env=user_models)
    assert result.returncode == 0, result.output
    the_hash(result)
    (evaluation,) = metrics(tmp_path / "run", "eval")
    assert evaluation["test_accuracy"] > 0.5


@pytest.mark.parametrize("model, backend", [("Tagger", "mpi"), ("TaggerWithLoss", "gloo")])
def test_a_dataset_and_model_of_any_shape_train(tmp_path, data_dir, user_models, model,
                                                 backend):
    """--dataset and --model factories of the user's own: token sequences [B, 8] in, logits
    [B, 8, 20] out; cross-entropy over the last dimension by default, or the model's loss."""
    result = train(2, tmp_path / "run", data_dir, "--dataset", "mymodels:counting", "--model",
                   f"mymodels:{model}", "--epochs", "2", "--lr", "0.5",
                   "--global-batch-size", "32", backend=backend, env=user_models)
    assert result.returncode == 0, result.output
    the_hash(result)
    first, last = metrics(tmp_path / "run", "eval")
    assert last["test_loss"] < first["test_loss"], (first, last)
    assert ("test_accuracy" in last) is (model == "Tagger")


@pytest.mark.parametrize("flags, key", [
    (["--model", "autoencoder", "--lr", "1"], "test_loss"),  # SGD needs a larger step here
    (["--precision", "bf16"], "test_accuracy"),
    (["--model", "cnn", "--deterministic"], "test_accuracy"),  # the flag is harmless on CPU
])
def test_other_models_and_precisions_train(tmp_path, data_dir, flags, key):
    result = train(2, tmp_path, data_dir, *flags, "--epochs", "2")
    assert result.returncode == 0, result.output
    the_hash(result)
    first, last = metrics(tmp_path, "eval")
    assert ("test_accuracy" in last) == (key == "test_accuracy")
    assert last["test_loss"] < first["test_loss"]


