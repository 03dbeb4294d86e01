"""Where this process is: the Python stacks of all its threads, read from inside, without ptrace.

A thread of this process (``launcher.faults.hang_watch``) reads the other threads' frames
with ``sys._current_frames()``: no py-spy, no ptrace rights, which containers and clusters
rarely grant. It needs the GIL, so a process stopped or in a C call that holds the GIL cannot
answer; the asking rank names it as such (``launcher.faults.hang_diagnosis``).
"""

from __future__ import annotations

import sys
import threading
import traceback

from launcher.faults import call_site


def all_threads() -> str:
    """Every thread's stack, innermost call last, as ``traceback`` prints them."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the thread that asks: always here
        lines = "".join(traceback.format_stack(frame)).rstrip()
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n{lines}")
    return "\n\n".join(parts) + "\n"


def main_thread_at() -> tuple[str, str]:
    """Where the main thread is in code that is neither torch's nor launcher's: ``file:line``
    and the function (the innermost such frame)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return at(frame)


def at(frame) -> tuple[str, str]:
    """``file:line`` and function of the innermost user frame from ``frame`` outward."""
    code, lasti = call_site.caller(frame)
    if code is None:
        return "?", "?"
    where = call_site.where(code, lasti)
    return where, code.co_name
