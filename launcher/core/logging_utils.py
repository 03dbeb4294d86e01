"""What people see: rank-0 log lines or a progress bar, JSON-lines metrics, parameter hashes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from launcher.core.curves import Curves


class RankLog:
    """Log lines and metrics from rank 0 only; other ranks stay quiet (errors aside)."""

    def __init__(self, is_main: bool, metrics_path: Path | None, stream: TextIO | None = None,
                 curves: Curves | None = None):
        self.is_main = is_main
        # sys.stdout as it is now, not at import: launcher.core.rank_output may have teed it
        self.stream = stream or sys.stdout
        # a progress bar only where someone watches a terminal; plain lines in job logs
        self.tty = is_main and self.stream.isatty()
        self._bar_open = False
        self._metrics = None
        self._curves = curves  # the metrics as TensorBoard curves too (launcher.curves)
        # opened at the first record: a run that ends in a user error leaves no empty file,
        # but a path that cannot be written is still found here (OSError), before training
        self._metrics_path = metrics_path if is_main else None
        if self._metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            if metrics_path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "Is a directory", str(metrics_path))
            if not os.access(metrics_path if metrics_path.exists() else metrics_path.parent,
                             os.W_OK):
                raise PermissionError(errno.EACCES, "Permission denied", str(metrics_path))

    def info(self, text: str) -> None:
        if self.is_main:
            self._end_bar()
            print(text, file=self.stream, flush=True)

    def warn(self, text: str) -> None:
        if self.is_main:
            self._end_bar()
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def progress(self, step: int, total: int, text: str) -> None:
        """A bar redrawn in place on a terminal; a plain line otherwise."""
        if not self.is_main:
            return
        if not self.tty:
            print(f"step {step}/{total} {text}", file=self.stream, flush=True)
            return
        width = 30
        done = width * step // max(total, 1)
        bar = "#" * done + "." * (width - done)
        self.stream.write(f"\r[{bar}] {step}/{total} {text}\x1b[K")
        self.stream.flush()
        self._bar_open = True

    def metrics(self, record: dict) -> None:
        if self._metrics is None and self._metrics_path is not None:
            self._metrics = self._metrics_path.open("a", encoding="utf-8")
        if self._metrics is not None:
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self._metrics.flush()
        if self._curves is not None:
            self._curves.log_record(record)

    def close(self) -> None:
        self._end_bar()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._curves is not None:
            self._curves.close()

    def _end_bar(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False


def print_lines(rank: int, text: str, stream: TextIO = sys.stdout) -> None:
    """Every line of ``text`` prefixed ``[rank R]``, written whole lines at a time: under mpiexec
    the ranks' output meets in one stream, where a write of at most ``PIPE_BUF`` bytes (4 KiB)
    arrives in one piece and a line split over two writes can take another rank's between."""
    lines = [f"[rank {rank}] {line}\n".encode() for line in text.split("\n")]
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no file behind it (a test's)
        stream.write(b"".join(lines).decode())
        stream.flush()
        return
    stream.flush()
    chunk = b""
    for line in lines:
        if chunk and len(chunk) + len(line) > select.PIPE_BUF:
            _write_all(fd, chunk)
            chunk = b""
        chunk += line
    _write_all(fd, chunk)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def parameter_sha256(module: nn.Module) -> str:
    """SHA-256 over the bytes of every parameter (CPU copies) in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()

