"""The built-in models, a user's own ``package.module:factory``, and what each is trained on.

The built-in models take images ``[B, 1, 28, 28]``: classifiers return logits ``[B, classes]``,
the auto-encoder a reconstruction of the input's shape. A user's model takes whatever its
dataset gives and is trained on its own ``loss(outputs, targets)`` method when it has one, else
on cross-entropy over the last dimension of its output for integer targets (logits
``[B, ..., classes]`` for targets ``[B, ...]``, with accuracy) or mean squared error for float
targets. ``check_output`` runs two samples through a freshly built model, so a wrong shape is a
clear error before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from launcher.core.errors import LaunchError
from launcher.training.config import BUILTIN
from launcher.training.factories import load_factory

PIXELS = 28 * 28


@dataclass(frozen=True)
class ModelSpec:
    """A built model and what it is trained for."""

    module: nn.Module
    #: "classify" (cross-entropy over the output's last dimension, accuracy), "regress" (MSE
    #: on float targets), "reconstruct" (MSE on the input) or "custom" (the module's ``loss``)
    task: str

    def loss(self, outputs: torch.Tensor, inputs: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch."""
        if self.task == "custom":
            return self.module.loss(outputs, targets)
        if self.task == "reconstruct":
            return F.mse_loss(outputs.float(), inputs)
        if self.task == "regress":
            return F.mse_loss(outputs.float(), targets)
        return F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten())

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int] | None:
        """Right predictions and predictions made, for a classifier; None otherwise."""
        if self.task != "classify":
            return None
        return int((outputs.argmax(-1) == targets).sum()), targets.numel()


def mlp(num_classes: int = 10, dropout: float = 0.1) -> nn.Module:
    """The classic MLP classifier: 784-256-128-classes with ReLU and dropout."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(PIXELS, 256), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(256, 128), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(128, num_classes),
    )


class AutoEncoder(nn.Module):
    """The classic MLP auto-encoder: 784-128-32-128-784, sigmoid output in [0, 1]."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(PIXELS, 128), nn.ReLU(),
                                     nn.Dropout(dropout), nn.Linear(128, 32), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, PIXELS),
                                     nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x)).view_as(x)


def cnn(num_classes: int = 10, dropout: float = 0.1) -> nn.Module:
    """A small CNN with batch norm: two conv-BN-ReLU-pool blocks and a linear head."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(1, 16), *block(16, 32), nn.Flatten(), nn.Dropout(dropout),
                         nn.Linear(32 * 7 * 7, num_classes))


def build_model(name: str, num_classes: int, dropout: float,
                float_targets: bool = False) -> ModelSpec:
    """A built-in model by name, or ``package.module:factory`` called without arguments."""
    if name == "mlp":
        return ModelSpec(mlp(num_classes, dropout), "classify")
    if name == "autoencoder":
        return ModelSpec(AutoEncoder(dropout), "reconstruct")
    if name == "cnn":
        return ModelSpec(cnn(num_classes, dropout), "classify")
    if ":" not in name:
        raise LaunchError(f"unknown model {name!r}",
                          hint=f"use one of {', '.join(BUILTIN)} or package.module:factory")
    return _user_model(name, float_targets)


def _user_model(spec: str, float_targets: bool) -> ModelSpec:
    # what the factory raises is a bug in it, not an input: it keeps its traceback and ends
    # the job through launcher.faults.failfast
    module = load_factory(spec)()
    if not isinstance(module, nn.Module):
        raise LaunchError(f"the factory {spec} returned {type(module).__name__}, not a "
                          "torch.nn.Module",
                          hint="make the factory return the model (an nn.Module instance)")
    if callable(getattr(module, "loss", None)):
        return ModelSpec(module, "custom")
    return ModelSpec(module, "regress" if float_targets else "classify")


def check_output(spec: ModelSpec, inputs: torch.Tensor, targets: torch.Tensor,
                 num_classes: int, name: str) -> None:
    """Run ``inputs`` through the model (eval mode, no grad) and check that its output fits
    its loss: the shape for the built-in losses, the user's ``loss`` run once otherwise."""
    was_training = spec.module.training
    spec.module.eval()
    try:
        with torch.no_grad():
            out = spec.module(inputs)
    except Exception as exc:  # any failure inside the user's forward
        raise LaunchError(f"model {name} fails on a batch of shape {list(inputs.shape)}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                          hint="the model must accept the dataset's inputs (the built-in "
                          "datasets give images [B, 1, 28, 28])") from None
    finally:
        spec.module.train(was_training)
    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if spec.task == "custom":
        try:
            spec.loss(out, inputs, targets)
        except Exception as exc:  # whatever the user's loss raises on a wrong shape
            raise LaunchError(f"model {name}'s loss fails on its output {got} and targets "
                              f"{list(targets.shape)}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]}",
                              hint="make loss(outputs, targets) accept what forward returns "
                              "and the dataset's targets") from None
        return
    expected = {"classify": [*targets.shape, num_classes], "regress": list(targets.shape),
                "reconstruct": list(inputs.shape)}[spec.task]
    fits = isinstance(out, torch.Tensor) and (
        list(out.shape) == expected if spec.task != "classify"
        else list(out.shape[:-1]) == expected[:-1] and out.shape[-1] >= num_classes)
    if not fits:
        hint = (f"a classifier must return logits {['B', *expected[1:]]} ({num_classes} classes "
                "in this dataset), or define loss(outputs, targets)" if spec.task == "classify"
                else "return the shape above, or define loss(outputs, targets)")
        raise LaunchError(f"model {name} returns {got} for a batch of {len(inputs)}, "
                          f"expected {expected}", hint=hint)
