"""The import graph read from the source (``ast``, TYPE_CHECKING imports too): no cycle in
``ddp_tasks`` or ``launcher``, and the rank side never imports the host side; the host side
loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the top-level modules it imports (all of them)."""
    graph = {}
    for path in sorted((ROOT / package).glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[f"{package}.{path.stem}"] = found
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle among the modules of ``graph``, or []."""
    edges = {module: sorted(found & graph.keys()) for module, found in graph.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for dependency in edges[module]:
            if found := visit(dependency, [*path, module]):
                return found
        done.add(module)
        return []

    return next((found for module in edges if (found := visit(module, []))), [])


@pytest.mark.parametrize("package", ["ddp_tasks", "launcher"])
def test_no_import_cycle(package):
    assert cycle(imports(package)) == []


def test_cycle_finds_one():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "os"}, "p.d": set()}
    assert cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]


def test_the_rank_side_needs_no_host_side():
    host = {module for module, found in imports("launcher").items()
            if any(name.split(".")[0] == "ddp_tasks" for name in found)}
    assert host == set()


def test_the_tasks_do_not_load_torch():
    """invoke starts in a fraction of a second: torch (seconds to import) is for the ranks."""
    probe = "import sys, tasks; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
