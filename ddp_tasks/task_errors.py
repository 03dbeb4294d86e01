"""How every task shows a user's mistake: the ``error:`` and ``HINT:`` lines, exit status 2,
no traceback (the tasks' side of ``launcher.errors``)."""

from __future__ import annotations

from contextlib import contextmanager

from invoke.exceptions import Exit

from launcher.errors import EXIT_USER_ERROR, LaunchError


@contextmanager
def user_errors():
    """Turn a LaunchError into invoke's clean exit: the message and HINT, no traceback."""
    try:
        yield
    except LaunchError as error:
        raise Exit(str(error), code=EXIT_USER_ERROR) from None
