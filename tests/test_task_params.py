"""Task parameters derived from dataclass fields: help text and defaults written once."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ddp_tasks import launch
from ddp_tasks.batch_script import Batch
from ddp_tasks.launch_spec import Launch
from ddp_tasks.task_params import documented, field_help
from launcher.core.field_docs import field_docs


@dataclasses.dataclass(frozen=True)
class Sample:
    count: int = 3
    """how many"""

    #: where to, the comment form
    #: over two lines
    place: str = "here"
    flag: bool = False
    """a switch"""

    said: str = "x"
    """the default is spoken of here"""

    bare: str = ""


def test_field_docs_reads_docstrings_and_comments():
    assert field_docs(Sample) == {
        "count": "how many", "place": "where to, the comment form over two lines",
        "flag": "a switch", "said": "the default is spoken of here",
    }


def test_field_help_appends_the_fields_default():
    help_ = field_help([Sample], ["count", "place", "flag", "said", "other"],
                       notes={"other": "a task's own", "bare": "unused"}, repeatable=["other"])
    assert help_ == {"count": "how many (default 3)",
                     "place": "where to, the comment form over two lines (default here)",
                     "flag": "a switch", "said": "the default is spoken of here",
                     "other": "a task's own (repeatable)"}


def test_an_undocumented_parameter_fails_at_import():
    with pytest.raises(TypeError, match="'bare' has no help"):
        documented(Sample)(lambda c, bare="": None)


@pytest.mark.parametrize("task", [launch.run, launch.sbatch])
def test_task_defaults_are_the_fields_defaults(task):
    """Every parameter named after a field (or renamed to one) defaults to the field's value,
    unless it is an unset marker ("", None) that the task replaces (hosts, args, signal)."""
    fields = {f.name: f.default for cls in (Launch, Batch) for f in dataclasses.fields(cls)}
    checked = 0
    for name, parameter in inspect.signature(task.body).parameters.items():
        field = launch.RENAMED.get(name, name)
        if field in fields and parameter.default not in ("", None):
            default = parameter.default
            if isinstance(default, str) and not isinstance(fields[field], str):
                default = type(fields[field])(default)  # sbatch's --nodes takes a range too
            assert default == fields[field], name
            checked += 1
    assert checked >= 5
    assert set(task.help) == set(inspect.signature(task.body).parameters) - {"c"}
