"""Built-in models and loading a user's ``package.module:factory``, with its errors."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from launcher.core.errors import LaunchError
from launcher.training.gradient_sync import reads_buffers_in_training
from launcher.training.models import build_model, check_output

BATCH = torch.rand(3, 1, 28, 28)
LABELS = torch.tensor([1, 0, 9])


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A throwaway importable module ``usermodels`` holding the factories the tests need."""
    (tmp_path / "usermodels.py").write_text(
        "import torch.nn as nn\n"
        "def good():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
        "def wrong_classes():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 7))\n"
        "def wrong_input():\n    return nn.Linear(10, 10)\n"
        "def not_a_module():\n    return 42\n"
        "def raises():\n    raise RuntimeError('no weights here')\n"
        "NOT_CALLABLE = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermodels"
    sys.modules.pop("usermodels", None)


@pytest.mark.parametrize("name, task, shape", [
    ("mlp", "classify", (3, 10)), ("cnn", "classify", (3, 10)),
    ("autoencoder", "reconstruct", (3, 1, 28, 28)),
])
def test_builtin_models(name, task, shape):
    spec = build_model(name, 10, dropout=0.1)
    assert spec.task == task
    check_output(spec, BATCH, LABELS, 10, name)
    assert spec.module(BATCH).shape == shape
    assert spec.module.training  # check_output leaves the mode as it found it


def test_cnn_has_batch_norm_to_convert():
    spec = build_model("cnn", 10, dropout=0.0)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(spec.module)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())


def test_user_factory_loads(user_module):
    spec = build_model(f"{user_module}:good", 10, dropout=0.1)
    assert spec.task == "classify"
    check_output(spec, BATCH, LABELS, 10, "good")


@pytest.mark.parametrize("factory, message", [
    ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("{mod}:missing", "has no callable 'missing'"),
    ("{mod}:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ("{mod}:not_a_module", "returned int, not a torch.nn.Module"),
])
def test_user_factory_errors(user_module, factory, message):
    with pytest.raises(LaunchError, match=message) as info:
        build_model(factory.format(mod=user_module), 10, dropout=0.1)
    assert info.value.hint


def test_what_a_factory_raises_keeps_its_type_and_traceback(user_module):
    with pytest.raises(RuntimeError, match="no weights here"):
        build_model(f"{user_module}:raises", 10, dropout=0.1)


@pytest.mark.parametrize("factory, message", [
    ("wrong_classes", r"returns \[3, 7\] for a batch of 3, expected \[3, 10\]"),
    ("wrong_input", "fails on a batch of shape"),
])
def test_user_model_shape_errors(user_module, factory, message):
    spec = build_model(f"{user_module}:{factory}", 10, dropout=0.1)
    with pytest.raises(LaunchError, match=message):
        check_output(spec, BATCH, LABELS, 10, factory)


def test_unknown_builtin():
    with pytest.raises(LaunchError, match="unknown model 'resnet'"):
        build_model("resnet", 10, dropout=0.1)


@pytest.mark.parametrize(("module", "reads"), [
    pytest.param(build_model("cnn", 10, 0.1).module, False, id="cnn: batch norm only"),
    pytest.param(build_model("mlp", 10, 0.1).module, False, id="mlp: no buffers"),
    pytest.param(nn.SyncBatchNorm(4), False, id="SyncBatchNorm"),
    pytest.param(nn.Sequential(nn.Linear(2, 2), nn.InstanceNorm1d(2, track_running_stats=True)),
                 True, id="another layer with buffers"),
])
def test_only_buffers_other_than_batch_norms_must_follow_rank_0_every_step(module, reads):
    assert reads_buffers_in_training(module) is reads


class Tagger(nn.Module):
    """Token sequences [B, L] to logits [B, L, 5]: a shape of its own, not 28x28 images."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 8), nn.Linear(8, 5)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


class WithOwnLoss(Tagger):
    def loss(self, outputs, targets):
        return (outputs.logsumexp(-1) - outputs.gather(-1, targets[..., None])[..., 0]).mean()


def _spec(module, float_targets=False, monkeypatch=None):
    monkeypatch.setitem(sys.modules, "mine", type(sys)("mine"))
    sys.modules["mine"].make = lambda: module
    return build_model("mine:make", 0, dropout=0.0, float_targets=float_targets)


def test_any_shape_classifies_over_the_last_dimension(monkeypatch):
    spec = _spec(Tagger(), monkeypatch=monkeypatch)
    tokens = torch.randint(5, (2, 7))
    assert spec.task == "classify"
    check_output(spec, tokens, tokens, 5, "mine:make")
    out = spec.module(tokens)
    assert spec.loss(out, tokens, tokens).shape == ()
    assert spec.correct(out, tokens)[1] == 14  # every token is a prediction


def test_a_model_with_its_own_loss_is_trained_on_it(monkeypatch):
    spec = _spec(WithOwnLoss(), monkeypatch=monkeypatch)
    tokens = torch.randint(5, (2, 7))
    assert spec.task == "custom" and spec.correct(spec.module(tokens), tokens) is None
    check_output(spec, tokens, tokens, 5, "mine:make")
    with pytest.raises(LaunchError, match="loss fails on its output"):
        check_output(spec, tokens, tokens[:, :3], 5, "mine:make")


def test_float_targets_are_regressed(monkeypatch):
    spec = _spec(nn.Linear(4, 2), float_targets=True, monkeypatch=monkeypatch)
    assert spec.task == "regress"
    check_output(spec, torch.rand(3, 4), torch.rand(3, 2), 0, "mine:make")
    with pytest.raises(LaunchError, match=r"returns \[3, 2\] for a batch of 3, expected \[3\]"):
        check_output(spec, torch.rand(3, 4), torch.rand(3), 0, "mine:make")
