"""c10d's C++ log, silenced where a failure is expected or already reported: a leaf beside the
modules that talk to a store that may be gone (peer_lost, heartbeat, failfast, rendezvous)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def quiet_c10d() -> Iterator[None]:
    """c10d's C++ log silenced inside: where a failure is expected or known, each store call
    that fails logs it again with a C++ stack, and the one message this code prints says it
    all. The level is restored on the way out."""
    try:
        libc10 = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        level = ctypes.c_int.in_dll(libc10, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another build of torch: its noise stays
        yield
        return
    saved, level.value = level.value, 3  # FATAL only
    try:
        yield
    finally:
        level.value = saved
