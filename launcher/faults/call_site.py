"""Where a call comes from: the first Python frame outside torch and launcher, as the flight
recorder (``launcher.faults.flight_recorder``) and the stacks (``launcher.faults.stacks``) name it.

Kept as a code object and a bytecode offset on the hot path; ``line_of`` and ``short`` make the
``file:line`` when someone reads it.
"""

from __future__ import annotations

import os
import sysconfig

import torch

import launcher

#: the frames a call's place skips: torch's, this package's and the standard library's
#: (``python -m``'s runpy, context managers, thread waits), not the installed packages'
_TORCH, _LAUNCHER = (os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                     for m in (torch, launcher))
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep

#: code object -> its kind (``_kind``): looked up on every recorded call
kinds: dict[object, int] = {}


def _kind(code) -> int:
    """0: the user's code, 1: launcher's, 2: torch's or the standard library's."""
    kind = kinds.get(code)
    if kind is None:
        name = code.co_filename
        path = os.path.abspath(name)
        stdlib = name.startswith("<frozen") or (
            path.startswith(_STDLIB) and "-packages" + os.sep not in path)
        kind = kinds[code] = (2 if stdlib or path.startswith(_TORCH)
                               else 1 if path.startswith(_LAUNCHER) else 0)
    return kind


def caller(frame) -> tuple[object, int]:
    """The code and bytecode offset (``f_lasti``: cheaper than ``f_lineno``; ``line_of`` turns
    it into a line) of the first frame from ``frame`` outward that is neither torch's nor
    launcher's; when all are (``launcher.train``), of the first launcher one."""
    first_launcher = None
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code)
        if kind is None:
            kind = _kind(code)
        if kind == 0:
            return code, frame.f_lasti
        if kind == 1 and first_launcher is None:
            first_launcher = frame
        frame = frame.f_back
    if first_launcher is None:
        return None, 0
    return first_launcher.f_code, first_launcher.f_lasti


def line_of(code, lasti: int) -> int:
    """The source line of bytecode offset ``lasti`` in ``code``."""
    line = code.co_firstlineno
    for start, end, number in code.co_lines():
        if start <= lasti < end and number is not None:
            return number
    return line


def short(path: str) -> str:
    """A path relative to the working directory when inside it, else as given."""
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def where(code, lasti: int) -> str:
    """``file:line`` of bytecode offset ``lasti`` in ``code``."""
    return f"{short(code.co_filename)}:{line_of(code, lasti)}"
