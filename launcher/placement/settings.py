"""The one writer of this process's environment: what a rank sets for the libraries it loads
(mpi4py, MPICH, Open MPI, UCX, libfabric, gloo, NCCL, cuBLAS), each with its reason, so that
``python -m launcher.env --json`` and ``launcher.check --json`` say what was set and why.

Libraries read their variables when they start, so each is set before the library that reads
it loads; processes the rank starts later inherit them. A variable the user set stays as it is
(recorded as the user's) unless the launcher must decide it (``decide``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Setting:
    """One variable of the process environment the launcher set or left to the user."""

    name: str
    value: str
    #: why the launcher wants this value (for a variable the user set: what it would have set)
    why: str
    #: "launcher": set here; "user": the user's own value, left as it was
    source: str


# what this process set, in order: the environment's own record of its writer, read only
# through ``applied`` (os.environ itself is process-wide; so is the record of its changes)
_applied: dict[str, Setting] = {}


def user_value(name: str) -> str | None:
    """The value of ``name`` the launcher did not set: the user's (or an outer launcher's)."""
    if name in _applied and _applied[name].source == "launcher":
        return None
    return os.environ.get(name)


def prefer(name: str, value: str, why: str) -> str:
    """Set ``name`` unless the user set it; the value in effect."""
    own = user_value(name)
    if own is not None:
        _applied.setdefault(name, Setting(name, own, why, "user"))
        return own
    decide(name, value, why)
    return value


def decide(name: str, value: str, why: str) -> None:
    """Set ``name`` whatever it was: a value the launcher alone can choose."""
    os.environ[name] = value
    _applied[name] = Setting(name, value, why, "launcher")


def applied() -> list[dict[str, str]]:
    """What this process set or left to the user, in order."""
    return [asdict(setting) for setting in _applied.values()]
