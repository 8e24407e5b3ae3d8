"""The library's import layering, read from the source: each package of ``harness`` imports only its own layer or
the layers below it, and no module of ``harness`` reaches itself through its imports.

The layers, bottom up: the registry type and the path names every layer uses; the process layer (worlds, the
torchrun transport, what a task carries, progress, stopping), which ships a function, its arguments and captured
contexts without knowing what those contexts are (applied ablations, implementations under test are registered from
above); judging (metrics, policies, checks and ablations); the extension registries and conformance; the inputs a
run reads (checkpoint kinds come from the registries); reports; the four paths; the pytest plugin on top. Every
import counts, those inside functions too: a deferred import only hides a circle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import harness

pytestmark = pytest.mark.cpu

ROOT = Path(harness.__file__).parent
LAYERS = (  # bottom up: a module may import its own layer and those before it
    ("base", ("harness", "harness.registry", "harness.paths")),
    ("process", ("harness.process",)),
    ("judging", ("harness.judging",)),
    ("plugins", ("harness.plugins",)),
    ("inputs", ("harness.inputs",)),
    ("reports", ("harness.reports",)),
    ("paths", ("harness.replay", "harness.ar", "harness.decode", "harness.attention")),
    ("plugin", ("harness.plugin", "harness.options", "harness.validation", "harness.placement", "harness.session",
                "harness.given_inputs", "harness.summary", "harness.invocation", "harness.workers")),
)
TOP_LEVEL_MODULES = 16  # at most this many modules at the top of harness/; the rest live in packages by concern


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer ``module`` belongs to (the longest matching prefix)."""
    best = (-1, -1)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (index, len(prefix))
    if best[0] < 0:
        raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")
    return best[0]


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
    return _graph_of(ROOT)


@functools.cache  # parsed once per root: the file's tests read the same sources
def _graph_of(root: Path) -> dict[str, set[str]]:
    files = {_module_name(path): path for path in root.rglob("*.py")}
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer into a layer above it, as ``module (layer) -> module (layer)``."""
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if layer_of(target) > layer_of(module):
                found.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    return found


def test_every_module_imports_only_its_own_layer_or_those_below():
    assert upward_imports(_graph()) == []


def test_the_process_layer_reaches_nothing_above_the_base():
    graph = _graph()
    process = [module for module in graph if layer_of(module) == 1]
    assert process, "the process layer moved: update LAYERS"
    assert {module: sorted(m for m in _reach(graph, module) if layer_of(m) > 1) for module in process} == \
        {module: [] for module in process}


def test_the_top_of_harness_holds_few_modules_and_packages_by_concern():
    modules = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, modules
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert {"process", "judging", "plugins", "inputs", "reports", "replay", "ar", "decode", "attention"} <= packages


def test_an_upward_import_is_found():
    graph = {"harness.process.dist": {"harness.judging.checks"}, "harness.judging.checks": {"harness.registry"}}
    assert upward_imports(graph) == ["harness.process.dist (process) -> harness.judging.checks (judging)"]
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("harness_elsewhere.x")


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
