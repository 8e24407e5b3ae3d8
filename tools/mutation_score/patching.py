"""Put a mutant into a live process: the imported module takes the mutated code in place.

A function mutant swaps the ``__code__`` of the live function object, so every reference to it
(``from m import f``, a registry entry, a seam's saved original, a decorator's wrapper) runs the
mutant. A module-constant mutant rebinds the name in its module and in every project module that
imported the same object under the same name. This runs in a forked child that exits afterwards,
so nothing is ever restored.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import sys
import types
from pathlib import Path
from typing import Any

from tools.mutation_score.operators import Mutant, apply, apply_in_place, module_bindings

__all__ = ["PatchError", "clear_caches", "index_caches", "patch_live"]


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


def patch_live(mutant: Mutant, *, roots: tuple[str, ...], in_place: bool = False) -> None:
    """Apply ``mutant`` to its already-imported module (imported here if it is not yet). ``in_place``: mutate
    the cached tree of the module (see ``operators.apply_in_place``), for a forked child that exits after."""
    if mutant.module.rsplit(".", 1)[-1] == "__init__":
        raise PatchError(f"{mutant.key}: {mutant.module} is a second copy of its package; mutate the package")
    module = importlib.import_module(mutant.module)
    path = Path(module.__file__ or "")
    source = path.read_text()
    tree = apply_in_place(source, mutant) if in_place else apply(source, mutant)
    if mutant.scope == "function":
        _patch_function(module, tree, mutant, str(path))
    elif mutant.scope == "default":
        _patch_default(module, tree, ast.parse(source), mutant)
    elif mutant.scope == "class":
        _patch_class(module, tree, mutant, roots)
    elif mutant.scope == "global":
        _patch_global(module, tree, mutant, roots)
    else:
        raise PatchError(f"unknown mutant scope {mutant.scope!r}")


def _compile_definition(tree: ast.Module, qualname: str, filename: str) -> list[types.CodeType]:
    """The code objects named ``qualname`` of the module statement that defines it, compiled alone (with the
    module's ``__future__`` imports): the rest of the module need not be compiled again for one mutant."""
    head = qualname.split(".")[0]
    future = [s for s in tree.body if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    statements = [s for s in tree.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                  and s.name == head]
    code = compile(ast.Module(body=[*future, *statements], type_ignores=[]), filename, "exec", dont_inherit=True)
    return [c for c in _code_objects(code) if c.co_qualname == qualname]


def _patch_function(module: types.ModuleType, tree: ast.Module, mutant: Mutant, filename: str) -> None:
    live = [f for f in _live_functions(module) if f.__qualname__ == mutant.qualname]
    if not live:
        raise PatchError(f"{mutant.key}: no live function {mutant.module}.{mutant.qualname} found")
    new_codes = _compile_definition(tree, mutant.qualname, filename)
    frees = {n for f in live for n in f.__code__.co_freevars}
    if any(c.co_freevars != f.__code__.co_freevars for c in new_codes for f in live
           if f.__code__.co_firstlineno == c.co_firstlineno):
        # the mutant dropped the last use of a closure variable (``super()``'s ``__class__``, say): a live
        # function keeps its cells, so the code must keep the names; a dead reference restores them
        tree = _keep_free_names(tree, mutant.qualname, frees)
        new_codes = _compile_definition(tree, mutant.qualname, filename)
    pairs = [(f, c) for c in new_codes for f in live if f.__code__.co_firstlineno == c.co_firstlineno]
    changed = [(f, c) for f, c in pairs if f.__code__ != c]
    if not changed:
        raise PatchError(f"{mutant.key}: no code object of {mutant.qualname} changed"
                         if pairs else f"{mutant.key}: no live function {mutant.module}.{mutant.qualname} found")
    for function, code in changed:
        try:
            function.__code__ = code
        except ValueError as err:  # the mutant changed the closure's free variables
            raise PatchError(f"{mutant.key}: {err}") from err


def _keep_free_names(tree: ast.Module, qualname: str, names: set[str]) -> ast.Module:
    """``tree`` with ``if False: (name, ...)`` appended to function ``qualname``: the compiler still counts
    names in dead code as free variables, so the code keeps the closure the live function carries."""
    for node in _definitions(tree, qualname):
        dead = ast.parse(f"if False:\n    ({', '.join(sorted(names))},)").body[0]
        node.body.append(dead)
    ast.fix_missing_locations(tree)
    return tree


def _definitions(tree: ast.Module, qualname: str) -> list[ast.AST]:
    """The function or class definitions of ``tree`` whose qualified name is ``qualname``."""
    found: list[ast.AST] = []
    scopes: list[tuple[str, ast.AST]] = [("", tree)]
    while scopes:
        prefix, node = scopes.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                if name == qualname:
                    found.append(child)
                if isinstance(child, ast.ClassDef):
                    scopes.append((f"{name}.", child))
    return found


def _evaluate(module: types.ModuleType, node: ast.expr, local: dict[str, Any] | None = None) -> Any:
    expression = ast.Expression(node)
    ast.fix_missing_locations(expression)
    return eval(compile(expression, module.__file__ or "<mutant>", "eval"), vars(module), local)


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line a compiled function's code starts at: its first decorator's, else its ``def``'s."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _patch_default(module: types.ModuleType, tree: ast.Module, original: ast.Module, mutant: Mutant) -> None:
    """Rebind the one default of function ``qualname`` that the mutant changed, on every live copy."""
    live = [f for f in _live_functions(module) if f.__qualname__ == mutant.qualname]
    patched = 0
    for new, old in zip(_definitions(tree, mutant.qualname), _definitions(original, mutant.qualname), strict=True):
        positional = [i for i, (a, b) in enumerate(zip(new.args.defaults, old.args.defaults, strict=True))
                      if ast.dump(a) != ast.dump(b)]
        keyword = [(arg.arg, a) for arg, a, b in zip(new.args.kwonlyargs, new.args.kw_defaults, old.args.kw_defaults,
                                                     strict=True) if a is not None and ast.dump(a) != ast.dump(b)]
        for function in live:
            if function.__code__.co_firstlineno != _first_line(old):
                continue
            if positional and function.__defaults__ is not None:
                values = list(function.__defaults__)
                for i in positional:
                    values[i] = _evaluate(module, new.args.defaults[i])
                function.__defaults__ = tuple(values)
                patched += 1
            for name, node in keyword:
                if function.__kwdefaults__ is not None:
                    function.__kwdefaults__[name] = _evaluate(module, node)
                    patched += 1
    if not patched:
        raise PatchError(f"{mutant.key}: no live function {mutant.module}.{mutant.qualname} took the default")


def _rebind(function: types.FunctionType, args: ast.arguments, module: types.ModuleType, names: set[str]) -> None:
    """Re-evaluate the defaults of ``function`` that name any of ``names`` (they were bound at import)."""
    if function.__defaults__ is not None and len(args.defaults) == len(function.__defaults__):
        function.__defaults__ = tuple(_evaluate(module, node) if _names(node) & names else value
                                      for node, value in zip(args.defaults, function.__defaults__, strict=True))
    for arg, node in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if node is not None and _names(node) & names and function.__kwdefaults__ is not None:
            function.__kwdefaults__[arg.arg] = _evaluate(module, node)


def _live_classes(module: types.ModuleType, qualname: str) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
            and v.__qualname__ == qualname] or [
        c for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
        for c in _nested_classes(v) if c.__qualname__ == qualname]


def _nested_classes(cls: type) -> list[type]:
    found = [cls]
    for value in vars(cls).values():
        if isinstance(value, type) and value.__qualname__.startswith(f"{cls.__qualname__}."):
            found += _nested_classes(value)
    return found


def _patch_class(module: types.ModuleType, tree: ast.Module, mutant: Mutant, roots: tuple[str, ...]) -> None:
    """Rebind class constant ``Class.NAME``: the class attribute and, for a dataclass field, the default its
    ``__init__`` (and every subclass's that inherits the field) was generated with."""
    owner, _, name = mutant.qualname.rpartition(".")
    node = next(iter(_definitions(tree, owner)), None)
    bindings = [v for n, v, _ in module_bindings(node.body) if n == name] if isinstance(node, ast.ClassDef) else []
    classes = _live_classes(module, owner)
    if not bindings or not classes:
        raise PatchError(f"{mutant.key}: class constant {mutant.qualname} not found")
    for cls in classes:
        _rebind_class_value(module, cls, name, bindings[0])


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _set_init_default(cls: type, name: str, value: Any) -> None:
    """The default ``dataclass`` bound into the generated ``__init__`` of ``cls`` for field ``name``."""
    init = vars(cls).get("__init__")
    if not isinstance(init, types.FunctionType):
        return
    code = init.__code__
    positional = code.co_varnames[:code.co_argcount]
    defaults = list(init.__defaults__ or ())
    if name in positional and positional.index(name) >= len(positional) - len(defaults):
        defaults[positional.index(name) - (len(positional) - len(defaults))] = value
        init.__defaults__ = tuple(defaults)
    elif init.__kwdefaults__ and name in init.__kwdefaults__:
        init.__kwdefaults__[name] = value


def _patch_global(module: types.ModuleType, tree: ast.Module, mutant: Mutant, roots: tuple[str, ...]) -> None:
    for name, node, stmt in module_bindings(tree.body):
        if name == mutant.qualname and stmt.lineno <= mutant.line <= (stmt.end_lineno or 0):
            value = _evaluate(module, node)
            break
    else:
        raise PatchError(f"{mutant.key}: module constant {mutant.qualname} not found")
    _rebind_everywhere(module, {mutant.qualname: value}, roots)


_MISSING = object()


def _rebind_everywhere(module: types.ModuleType, values: dict[str, Any], roots: tuple[str, ...]) -> None:
    """Rebind module constants in ``module`` and in every project module that imported the same object under
    the same name, then recompute, in each of those modules, what import computed from them."""
    work = [(module, {name: (vars(module).get(name, _MISSING), value) for name, value in values.items()})]
    for _ in range(64):  # derived constants are later statements: the chain ends
        if not work:
            return
        owner, rebound = work.pop(0)
        touched: dict[types.ModuleType, set[str]] = {owner: set(rebound)}
        for name, (old, value) in rebound.items():
            for other in _project_modules(roots):
                if other is owner or (old is not _MISSING and vars(other).get(name, _MISSING) is old):
                    setattr(other, name, value)
                    touched.setdefault(other, set()).add(name)
        for each, names in touched.items():
            derived = _recompute(each, names)
            if derived:
                work.append((each, derived))
    raise PatchError(f"rebinding {sorted(values)} in {module.__name__} did not settle")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _recompute(module: types.ModuleType, changed: set[str]) -> dict[str, tuple[Any, Any]]:
    """In ``module``, what import computed from the ``changed`` names, computed again: later module constants
    (``B = A * 2``, returned as ``name: (old, new)`` to be rebound where imported), the defaults of functions and
    methods (``k=TOLERANCE_K``) and class constants and dataclass field defaults (``eta: float = ETA``)."""
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
        return {}
    tree = ast.parse(Path(file).read_text(), file)
    names, derived = set(changed), {}
    for name, node, _ in module_bindings(tree.body):
        if name not in changed and _names(node) & names and name in vars(module):
            derived[name] = (vars(module)[name], _evaluate(module, node))
            setattr(module, name, derived[name][1])  # later statements of this module read the new value
            names.add(name)
    live = {f.__qualname__: f for f in _live_functions(module)}
    scopes: list[tuple[str, ast.AST]] = [("", tree)]
    while scopes:
        prefix, node = scopes.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and f"{prefix}{child.name}" in live:
                _rebind(live[f"{prefix}{child.name}"], child.args, module, names)
            elif isinstance(child, ast.ClassDef):
                scopes.append((f"{prefix}{child.name}.", child))
                for name, value, _ in module_bindings(child.body):
                    if _names(value) & names:
                        for cls in _live_classes(module, f"{prefix}{child.name}"):
                            _rebind_class_value(module, cls, name, value)
    return derived


def _rebind_class_value(module: types.ModuleType, cls: type, name: str, node: ast.expr) -> None:
    value = _evaluate(module, node, dict(vars(cls)))
    if isinstance(value, dataclasses.Field):
        value = value.default
    if name in vars(cls):
        setattr(cls, name, value)
    fields = getattr(cls, "__dataclass_fields__", {})
    if name in fields:
        fields[name].default = value
        for each in [cls, *_subclasses(cls)]:
            if each is cls or name not in vars(each):
                _set_init_default(each, name, value)


_CACHES: dict[tuple[str, ...], list[Any]] = {}


def index_caches(roots: tuple[str, ...]) -> None:
    """Find the project's functools caches once, in the runner before it forks: every child inherits the list
    instead of walking every module's namespace again (a module first imported later has empty caches)."""
    _CACHES[roots] = _find_caches(roots)


def _find_caches(roots: tuple[str, ...]) -> list[Any]:
    return [value for module in _project_modules(roots) for value in list(vars(module).values())
            if hasattr(value, "cache_clear") and hasattr(value, "__wrapped__")]


def clear_caches(roots: tuple[str, ...], labels: list[str] | None = None) -> None:
    """Empty the project's functools caches named in ``labels`` (all when None): their values are stale.

    A label is ``cache:<module>.<qualname>`` (the coverage map's name for the cache's computation).
    """
    wanted = None if labels is None or "*" in labels else set(labels)
    for value in _CACHES[roots] if roots in _CACHES else _find_caches(roots):
        if wanted is None or f"cache:{value.__module__}.{value.__qualname__}" in wanted:
            value.cache_clear()
