"""How every task shows a user's mistake: the ``error:`` and ``HINT:`` lines, exit status 2,
no traceback (the tasks' side of ``launcher.core.errors``); and how a task with ``--dry-run`` shows
the command it would run."""

from __future__ import annotations

import shlex
import shutil
from contextlib import contextmanager

from invoke.exceptions import Exit

from launcher.core.errors import EXIT_USER_ERROR, LaunchError


@contextmanager
def user_errors():
    """Turn a LaunchError into invoke's clean exit: the message and HINT, no traceback."""
    try:
        yield
    except LaunchError as error:
        raise Exit(str(error), code=EXIT_USER_ERROR) from None


def shown_only(command: list[str], dry_run: bool, install_hint: str) -> bool:
    """Print ``command``; True for a dry run; LaunchError when its program is not installed."""
    print(shlex.join(command), flush=True)
    if dry_run:
        return True
    if not shutil.which(command[0]):
        raise LaunchError(f"{command[0]} is not installed", hint=install_hint)
    return False
