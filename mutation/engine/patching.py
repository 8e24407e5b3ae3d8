"""Put a mutant into a live process: the imported module takes the mutated code in place.

A function mutant swaps the ``__code__`` of the live function object, so every reference to it
(``from m import f``, a registry entry, a seam's saved original, a decorator's wrapper) runs the
mutant. A module-constant mutant rebinds the name in its module and in every project module that
imported the same object under the same name. This runs in a forked child that exits afterwards,
so nothing is ever restored.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
import types
from pathlib import Path
from typing import Any

from mutation.engine.operators import Mutant, apply

__all__ = ["PatchError", "clear_caches", "patch_live"]


class PatchError(RuntimeError):
    """The mutant cannot be put into the live module (its status is then "error", not a kill)."""


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.extend(_code_objects(const))
    return found


def _live_functions(module: types.ModuleType) -> list[types.FunctionType]:
    """Every function object reachable from ``module``'s namespace that was defined in it."""
    name = module.__name__
    seen: set[int] = set()
    out: list[types.FunctionType] = []

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if obj.__module__ == name:
                out.append(obj)
            visit(getattr(obj, "__wrapped__", None), depth + 1)
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, staticmethod | classmethod):
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, property):
            for part in (obj.fget, obj.fset, obj.fdel):
                visit(part, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
        elif isinstance(obj, type):
            if obj.__module__ == name:
                for value in vars(obj).values():
                    visit(value, depth + 1)
        elif hasattr(obj, "__wrapped__"):
            visit(obj.__wrapped__, depth + 1)

    for value in list(vars(module).values()):
        visit(value, 0)
    return out


def _project_modules(roots: tuple[str, ...]) -> list[types.ModuleType]:
    return [m for n, m in list(sys.modules.items())
            if m is not None and n.split(".")[0] in roots]


def patch_live(mutant: Mutant, *, roots: tuple[str, ...]) -> None:
    """Apply ``mutant`` to its already-imported module (imported here if it is not yet)."""
    module = importlib.import_module(mutant.module)
    path = Path(module.__file__ or "")
    source = path.read_text()
    tree = apply(source, mutant)
    if mutant.scope == "function":
        _patch_function(module, tree, mutant, str(path))
    elif mutant.scope == "global":
        _patch_global(module, tree, mutant, roots)
    else:
        raise PatchError(f"unknown mutant scope {mutant.scope!r}")


def _patch_function(module: types.ModuleType, tree: ast.Module, mutant: Mutant, filename: str) -> None:
    mutated = compile(tree, filename, "exec", dont_inherit=True)
    original = compile(ast.parse(Path(filename).read_text(), filename), filename, "exec", dont_inherit=True)
    new_codes = [c for c in _code_objects(mutated) if c.co_qualname == mutant.qualname]
    old_codes = [c for c in _code_objects(original) if c.co_qualname == mutant.qualname]
    changed = [(old, new) for old, new in zip(old_codes, new_codes, strict=False) if old != new]
    if not changed:
        raise PatchError(f"{mutant.key}: no code object of {mutant.qualname} changed")
    live = [f for f in _live_functions(module) if f.__qualname__ == mutant.qualname]
    patched = 0
    for old, new in changed:
        for function in live:
            if function.__code__.co_firstlineno == old.co_firstlineno:
                try:
                    function.__code__ = new
                except ValueError as err:  # the mutant changed the closure's free variables
                    raise PatchError(f"{mutant.key}: {err}") from err
                patched += 1
    if not patched:
        raise PatchError(f"{mutant.key}: no live function {mutant.module}.{mutant.qualname} found")


def _patch_global(module: types.ModuleType, tree: ast.Module, mutant: Mutant, roots: tuple[str, ...]) -> None:
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == mutant.qualname and stmt.lineno <= mutant.line <= (stmt.end_lineno or 0)):
            expression = ast.Expression(stmt.value)
            ast.fix_missing_locations(expression)
            value = eval(compile(expression, module.__file__ or "<mutant>", "eval"), vars(module))
            break
    else:
        raise PatchError(f"{mutant.key}: module constant {mutant.qualname} not found")
    old = vars(module).get(mutant.qualname)
    for other in _project_modules(roots):
        if other is module or vars(other).get(mutant.qualname) is old:
            setattr(other, mutant.qualname, value)
    _rebind_defaults(module, tree, mutant.qualname, value)


def _rebind_defaults(module: types.ModuleType, tree: ast.Module, name: str, value: Any) -> None:
    """A default written as ``arg=NAME`` was evaluated at import: give the live function the mutated value."""
    live = {f.__qualname__: f for f in _live_functions(module)}
    scopes: list[tuple[str, ast.AST]] = [("", tree)]
    while scopes:
        prefix, node = scopes.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                scopes.append((f"{prefix}{child.name}.", child))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                function = live.get(f"{prefix}{child.name}")
                if function is not None:
                    _rebind(function, child.args, name, value)


def _rebind(function: types.FunctionType, args: ast.arguments, name: str, value: Any) -> None:
    positional = args.defaults
    if function.__defaults__ is not None and any(isinstance(d, ast.Name) and d.id == name for d in positional):
        function.__defaults__ = tuple(value if isinstance(d, ast.Name) and d.id == name else live_value
                                      for d, live_value in zip(positional, function.__defaults__, strict=True))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if isinstance(default, ast.Name) and default.id == name and function.__kwdefaults__ is not None:
            function.__kwdefaults__[arg.arg] = value


def clear_caches(roots: tuple[str, ...], labels: list[str] | None = None) -> None:
    """Empty the project's functools caches named in ``labels`` (all when None): their values are stale.

    A label is ``cache:<module>.<qualname>`` (the coverage map's name for the cache's computation).
    """
    wanted = None if labels is None or "*" in labels else set(labels)
    for module in _project_modules(roots):
        for value in list(vars(module).values()):
            if not (hasattr(value, "cache_clear") and hasattr(value, "__wrapped__")):
                continue
            if wanted is None or f"cache:{value.__module__}.{value.__qualname__}" in wanted:
                value.cache_clear()
