"""The import graph read from the source (``ast``, TYPE_CHECKING imports too): no cycle in
``ddp_tasks`` or ``launcher``, ``launcher``'s subpackages imported only downwards in the order
of ``launcher.LAYERS`` (and docs/contributing.md drawing that order as it is), the rank side
never imports the host side, the host side loads no torch, benchmarks import no tests."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package``, subpackages included, and the dotted names it imports (all of
    them: ``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    graph = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[module_name(path)] = found
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


def floors(layers=launcher.LAYERS) -> dict[str, int]:
    """Each subpackage of ``launcher`` and its floor, 0 at the bottom."""
    return {package: floor for floor, row in enumerate(layers) for package in row}


def part(name: str, floor_of: dict[str, int]) -> str | None:
    """The subpackage of ``launcher`` a dotted name is in, "entry" for a module beside them
    (``launcher.train``), None outside ``launcher`` or for the package itself."""
    parts = name.split(".")
    if parts[0] != "launcher" or len(parts) < 2:
        return None
    if parts[1] in floor_of:
        return parts[1]
    return "entry" if (ROOT / "launcher" / f"{parts[1]}.py").exists() else None


def subpackage_graph(graph: dict[str, set[str]], floor_of: dict[str, int]) -> dict[str, set[str]]:
    """Which subpackage imports which (the entry modules left out: they import everything)."""
    edges: dict[str, set[str]] = {package: set() for package in floor_of}
    for module, found in graph.items():
        if (source := part(module, floor_of)) in floor_of:
            edges[source] |= {target for name in found
                              if (target := part(name, floor_of)) not in (None, source)}
    return edges


def against_the_order(graph: dict[str, set[str]], layers=launcher.LAYERS) -> list[str]:
    """``module -> name`` for each import of a subpackage on the same floor or above."""
    floor_of = {**floors(layers), "entry": len(layers)}
    wrong = []
    for module, found in sorted(graph.items()):
        source = part(module, floor_of)
        if source is None or source == "entry":
            continue
        wrong += [f"{module} -> {name}" for name in sorted(found)
                  if (target := part(name, floor_of)) not in (None, source)
                  and floor_of[target] >= floor_of[source]]
    return wrong


@pytest.mark.parametrize("package", ["ddp_tasks", "launcher"])
def test_no_import_cycle(package):
    assert cycle(imports(package)) == []


def test_cycle_finds_one():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "os"}, "p.d": set()}
    assert cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]


def test_the_walk_sees_the_subpackages():
    graph = imports("launcher")
    assert {"launcher.mpi.backend", "launcher.placement.env", "launcher.train"} <= graph.keys()
    assert "launcher.faults.heartbeat" in graph["launcher.mpi.waiting"]


def test_every_subpackage_is_a_layer_and_says_what_it_may_import():
    found = {path.parent.name: ast.get_docstring(ast.parse(path.read_text())) or ""
             for path in (ROOT / "launcher").glob("*/__init__.py")}
    assert sorted(found) == sorted(floors())
    assert [name for name, doc in found.items() if "May import:" not in doc] == []


def test_no_cycle_between_subpackages():
    floor_of = floors()
    assert cycle(subpackage_graph(imports("launcher"), floor_of)) == []


def test_subpackages_import_only_the_layers_below():
    assert against_the_order(imports("launcher")) == []


def test_the_order_check_finds_an_import_upwards_and_sideways():
    layers = (("low",), ("high", "side"))
    graph = {"launcher.low.a": {"launcher.high.b", "launcher.low.c"},
             "launcher.side.d": {"launcher.high", "launcher.high.b.f", "launcher.low.a"},
             "launcher.high.b": {"launcher.low.a.g", "os"}}
    assert against_the_order(graph, layers) == [
        "launcher.low.a -> launcher.high.b", "launcher.side.d -> launcher.high",
        "launcher.side.d -> launcher.high.b.f"]


def diagram() -> str:
    """The rank side's layers as docs/contributing.md draws them, from the code: each
    subpackage from the top down, its docstring's first line, its modules."""
    entries = " ".join(sorted(p.stem for p in (ROOT / "launcher").glob("*.py")
                              if p.stem != "__init__"))
    rows = [f"{'launcher/':12} python -m launcher.X: thin entry points; LAYERS in __init__.py",
            f"{'':12} {entries}"]
    for row in reversed(launcher.LAYERS):
        for package in row:
            folder = ROOT / "launcher" / package
            summary = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
            modules = " ".join(sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__"))
            rows.append(f"{package + '/':12} {summary.splitlines()[0]}")
            rows += textwrap.wrap(modules, 100, initial_indent=" " * 13,
                                  subsequent_indent=" " * 13)
    return "\n".join(rows)


def test_the_docs_draw_the_layers_of_the_code():
    """docs/contributing.md holds ``diagram()`` verbatim: a module moved, added or removed, or a
    layer renamed, fails here until the doc shows it (paste the block printed below)."""
    doc = (ROOT / "docs" / "contributing.md").read_text()
    assert f"```\n{diagram()}\n```" in doc, f"docs/contributing.md should show:\n{diagram()}"


def test_the_rank_side_needs_no_host_side():
    host = {module for module, found in imports("launcher").items()
            if any(name.split(".")[0] == "ddp_tasks" for name in found)}
    assert host == set()


def test_benchmarks_import_nothing_from_tests():
    found = {module for module, names in imports("benchmarks").items()
             if any(name.split(".")[0] == "tests" for name in names)}
    assert found == set()


def test_the_tasks_do_not_load_torch():
    """invoke starts in a fraction of a second: torch (seconds to import) is for the ranks."""
    probe = "import sys, tasks; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
