"""The built-in models and the loader for a user's own ``package.module:factory``.

All models take images ``[B, 1, 28, 28]``. Classifiers return logits ``[B, classes]``; the
auto-encoder returns a reconstruction of the input's shape. ``check_output`` runs one batch
through a freshly built model so that a wrong shape is a clear error before training starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from launcher.errors import LaunchError

BUILTIN = ("mlp", "autoencoder", "cnn")
PIXELS = 28 * 28


@dataclass(frozen=True)
class ModelSpec:
    """A built model and what it is trained for."""

    module: nn.Module
    #: "classify" (cross-entropy on labels, accuracy) or "reconstruct" (MSE on the input)
    task: str


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


def build_model(name: str, num_classes: int, dropout: float) -> ModelSpec:
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
    return _user_model(name)


def _user_model(spec: str) -> ModelSpec:
    # what the factory raises is a bug in it, not an input: it keeps its traceback and ends
    # the job through launcher.failfast
    module = load_factory(spec)()
    if not isinstance(module, nn.Module):
        raise LaunchError(f"the factory {spec} returned {type(module).__name__}, not a "
                          "torch.nn.Module",
                          hint="make the factory return the model (an nn.Module instance)")
    return ModelSpec(module, "classify")


def load_factory(spec: str):
    """Import ``package.module:factory`` and return the callable."""
    module_name, _, attr = spec.partition(":")
    hint = ("give --model as package.module:factory, where the module is importable (on "
            "PYTHONPATH, or installed in the image) and factory() returns an nn.Module")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail to import in any way
        raise LaunchError(f"cannot import {module_name!r} for --model {spec}: "
                          f"{type(exc).__name__}: {exc}", hint=hint) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LaunchError(f"{module_name} has no callable {attr!r} (--model {spec})", hint=hint)
    return factory


def check_output(spec: ModelSpec, sample: torch.Tensor, num_classes: int, name: str) -> None:
    """Run ``sample`` through the model (eval mode, no grad) and check the output's shape."""
    was_training = spec.module.training
    spec.module.eval()
    try:
        with torch.no_grad():
            out = spec.module(sample)
    except Exception as exc:  # any failure inside the user's forward
        raise LaunchError(f"model {name} fails on a batch of shape {list(sample.shape)}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                          hint="the model must accept images [B, 1, 28, 28]") from None
    finally:
        spec.module.train(was_training)
    expected = [len(sample), num_classes] if spec.task == "classify" else list(sample.shape)
    if not isinstance(out, torch.Tensor) or list(out.shape) != expected:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise LaunchError(f"model {name} returns {got} for a batch of {len(sample)}, "
                          f"expected {expected}",
                          hint=f"a classifier must return logits [B, {num_classes}] "
                          f"({num_classes} classes in this dataset)")
