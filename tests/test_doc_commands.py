"""Every fenced command of README.md and docs/ marked as runnable here, run as written.

A marker is an HTML comment on the line before the fence (docs/contributing.md, "Commands in
the docs run"):

- ``<!-- doc-test -->``: lines starting ``$ `` are commands (a trailing ``\\`` continues one)
  and the lines up to the next command their output, compared exactly (stdout and stderr
  together); a fence without ``$ `` lines holds one command per line, each must exit 0.
- ``<!-- doc-test: dry-run -->``: each command runs with ``--dry-run`` appended.
- ``<!-- doc-test: only REGEX -->``: only the commands REGEX finds something in run here.
- ``<!-- doc-test: file NAME -->``: the fence is file NAME as the commands of the file's
  previous marked fence write it.
- ``<!-- doc-test: slow -->``: takes more than a few seconds; pytest marker ``slow``.
- ``<!-- doc-test: snippet -->``: a Python snippet with a test of its own
  (tests/test_readme_snippet.py); skipped here.

Options combine with ``;``. Each fence runs in a fresh directory that holds ``tasks.py`` and
``.venv`` (the venv running the tests) as a clone does, with the venv's bin on PATH as after
``. .venv/bin/activate``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.mpi import REPO_ROOT, clean_environ

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"^<!-- doc-test(?::\s*(.*?))?\s*-->\n```[^\n]*\n(.*?)^```$", re.S | re.M)
TIMEOUT_S, SLOW_TIMEOUT_S = 60, 600


@dataclass(frozen=True)
class Fence:
    doc: Path
    line: int
    options: dict[str, str]
    body: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line}"

    def commands(self) -> list[tuple[str, str | None]]:
        """``(command, expected output or None)`` in order, filtered by ``only``."""
        lines = self.body.splitlines()
        if not any(line.startswith("$ ") for line in lines):
            pairs: list[list] = [[line, None] for line in lines if line.strip()]
        else:
            pairs = []
            for line in lines:
                if line.startswith("$ "):
                    pairs.append([line[2:], ""])
                elif pairs and pairs[-1][0].endswith("\\") and not pairs[-1][1]:
                    pairs[-1][0] += "\n" + line
                elif pairs:
                    pairs[-1][1] += line + "\n"
        only = self.options.get("only")
        return [(_dry(c) if "dry-run" in self.options else c, out) for c, out in pairs
                if only is None or re.search(only, c)]


def _dry(command: str) -> str:
    """``--dry-run`` added before the line's comment, if it has one."""
    return re.sub(r"(\s+#\s.*)?$", r" --dry-run\1", command, count=1)


def fences() -> list[Fence]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in MARKED.finditer(text):
            options = dict((part.strip().split(" ", 1) + [""])[:2]
                           for part in (match.group(1) or "").split(";") if part.strip())
            line = text.count("\n", 0, match.start()) + 2
            found.append(Fence(doc, line, options, match.group(2)))
    return found


def previous(fence: Fence) -> Fence:
    before = [f for f in fences() if f.doc == fence.doc and f.line < fence.line
              and "file" not in f.options]
    assert before, f"{fence.name}: `file` needs a marked fence with its command before it"
    return before[-1]


def clone_like(tmp_path: Path) -> dict[str, str]:
    """``tmp_path`` as a clone's root for the commands; their environment."""
    (tmp_path / "tasks.py").symlink_to(REPO_ROOT / "tasks.py")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = clean_environ()
    env.pop("DDP_PREEMPT_SIGNAL", None)
    env["PATH"] = f"{tmp_path / '.venv' / 'bin'}:{env['PATH']}"
    return env


def run(command: str, tmp_path: Path, env: dict[str, str], timeout: float):
    return subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def params() -> list:
    return [pytest.param(f, id=f.name, marks=[pytest.mark.slow] if "slow" in f.options else [])
            for f in fences() if "snippet" not in f.options]


@pytest.mark.parametrize("fence", params())
def test_the_docs_command_runs_as_written(tmp_path, fence):
    env = clone_like(tmp_path)
    timeout = SLOW_TIMEOUT_S if "slow" in fence.options else TIMEOUT_S
    source = previous(fence) if "file" in fence.options else fence
    commands = source.commands()
    assert commands, f"{fence.name}: marked, but no command to run"
    for command, expected in commands:
        result = run(command, tmp_path, env, timeout)
        if expected is None and "file" not in fence.options:
            assert result.returncode == 0, f"{fence.name}: {command}\n{result.stdout}"
        elif expected is not None:
            assert result.stdout == expected, f"{fence.name}: {command}"
    if "file" in fence.options:
        written = tmp_path / fence.options["file"]
        assert written.read_text() == fence.body, f"{fence.name}: {written.name} differs"


def test_the_markers_are_found():
    """A marker the pattern misses would silently test nothing."""
    counted = sum(len(re.findall(r"^<!-- doc-test", doc.read_text(), re.M)) for doc in DOCS)
    assert counted == len(fences()) > 0
