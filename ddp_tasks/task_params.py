"""Task parameters from dataclass fields: each default and each help text written once.

``launcher/training/config.py`` builds the training CLI from ``TrainConfig`` and its field
docstrings; the invoke tasks do the same here. invoke needs a real function signature, so a task
names each default as the dataclass's (``nodes=LAUNCH.nodes`` with ``LAUNCH = Launch()``) and gets
its help from the fields through ``documented``::

    @documented(Launch, Batch, notes={"dry_run": "print the command and exit"},
                renamed={"bind": "binds"}, iterable=["bind"])
    def run(c, nodes=LAUNCH.nodes, bind=None, dry_run=False): ...

A field's help is the docstring under it (or the ``#:`` comment above it), plus
"(default VALUE)" unless the text speaks of its default itself or there is none to show.
``notes`` documents the task's own parameters (and wins over a field's text); a parameter with
no text at all is an error at import, so ``invoke --help TASK`` never shows a blank.
Nothing here imports torch or the tasks: any task module may use it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable

from invoke import task

from launcher.core.field_docs import field_docs


def field_help(classes: Iterable[type], names: Iterable[str],
               notes: dict[str, str] | None = None, renamed: dict[str, str] | None = None,
               repeatable: Iterable[str] = ()) -> dict[str, str]:
    """invoke's ``help=`` for the parameters ``names``; ``renamed`` maps a parameter to its
    field when the flag is named otherwise (``bind`` -> ``binds``)."""
    notes, renamed, repeatable = notes or {}, renamed or {}, set(repeatable)
    docs, defaults = {}, {}
    for cls in classes:
        docs.update(field_docs(cls))
        defaults.update({f.name: f.default for f in dataclasses.fields(cls)})
    help_ = {}
    for name in names:
        field = renamed.get(name, name)
        text = notes.get(name) or docs.get(field)
        if not text:
            raise TypeError(f"task parameter {name!r} has no help: document field {field!r} "
                            "or give it a note")
        default = defaults.get(field, dataclasses.MISSING)
        if (default not in (dataclasses.MISSING, "", (), None) and not isinstance(default, bool)
                and "default" not in text):
            text += f" (default {default})"
        help_[name] = text + (" (repeatable)" if name in repeatable else "")
    return help_


def documented(*classes: type, notes: dict[str, str] | None = None,
               renamed: dict[str, str] | None = None,
               **task_options) -> Callable[[Callable], object]:
    """``@task`` with ``help=`` derived from ``classes`` for every parameter of the function
    (``iterable`` parameters say they repeat); other options go to invoke's ``task``."""
    def decorate(function: Callable):
        names = list(inspect.signature(function).parameters)[1:]  # not the context
        help_ = field_help(classes, names, notes, renamed, task_options.get("iterable", ()))
        return task(help=help_, **task_options)(function)

    return decorate
