"""``package.module:factory``: how ``--model`` and ``--dataset`` name a user's own code."""

from __future__ import annotations

import importlib

from launcher.core.errors import LaunchError


def load_factory(spec: str, flag: str = "--model"):
    """Import ``package.module:factory`` and return the callable."""
    module_name, _, attr = spec.partition(":")
    hint = (f"give {flag} as package.module:factory, where the module is importable (on "
            "PYTHONPATH, or installed in the image)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail to import in any way
        raise LaunchError(f"cannot import {module_name!r} for {flag} {spec}: "
                          f"{type(exc).__name__}: {exc}", hint=hint) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LaunchError(f"{module_name} has no callable {attr!r} ({flag} {spec})", hint=hint)
    return factory
