"""The library's import layering, read from the source: the process layer knows nothing of the domain, and no
module of ``harness`` reaches itself through its imports.

The process layer (worlds, the torchrun transport, what a task carries, the registry type) ships a function,
its arguments and captured contexts; what those contexts are (applied ablations, implementations under test)
is registered from above. Every import counts, those inside functions too: a deferred import only hides a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import harness

pytestmark = pytest.mark.cpu

ROOT = Path(harness.__file__).parent
PROCESS_LAYER = ("harness.dist", "harness.launch", "harness.carried", "harness.registry")
DOMAIN = ("harness.ablation", "harness.checks", "harness.conformance")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``harness`` that ``name`` imports anywhere in its source (``from pkg import mod`` included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known and module != name}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in ROOT.rglob("*.py")}
    known = set(files)
    return {name: _imported(name, path, known) for name, path in files.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_process_layer_reaches_no_domain_module():
    graph = _graph()
    assert set(PROCESS_LAYER) <= set(graph), "a process-layer module moved: update PROCESS_LAYER"
    reached = {module: sorted(_reach(graph, module) & set(DOMAIN)) for module in PROCESS_LAYER}
    assert reached == {module: [] for module in PROCESS_LAYER}


def test_no_module_of_harness_imports_itself_through_others():
    assert _circles(_graph()) == []


def test_the_reader_sees_a_circle_and_a_relative_import(tmp_path, monkeypatch):
    """The two tests above can fail: a planted circle through a relative import is found."""
    package = tmp_path / "harness"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from harness.a import x\n")
    (package / "c.py").write_text("import harness.b\n")
    monkeypatch.setattr(f"{__name__}.ROOT", package)
    graph = _graph()
    assert graph["harness.c"] == {"harness.b"}
    assert _circles(graph) == [["harness.a", "harness.b"]]
    assert _reach(graph, "harness.c") == {"harness", "harness.a", "harness.b"}  # "from . import b" reads the package
