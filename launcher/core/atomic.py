"""Atomic file writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # the rename itself must reach the disk, or a crash could bring the old directory back
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        # some network and FUSE file systems cannot sync a directory (fsync(2): EINVAL): the
        # file is whole and renamed, which is all they offer; not a failed write
        if exc.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(dir_fd)


_NO_DIRECTORY_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def _new_beside(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path``, created exclusively like ``mkstemp`` but with the
    mode ``open`` gives (0666 less the umask, as ``torch.save``'s): mkstemp's 0600 would keep a
    checkpoint or ``exit-status`` from a teammate on the same shared file system."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
