"""Mutation operators over Python source: where a plausible one-token bug can go, and the mutated tree.

A site is found by walking the module's AST in a fixed order; a mutant names its site by that walk
index, so the same source always yields the same mutants. What is mutated is what reaches behaviour:
function bodies (methods, lambdas and nested functions included), the defaults of functions and methods,
module constants (``NAME = <number expression>``, annotated or not, and ``A, B = 1, 2``) and class
constants and dataclass field defaults (``channel_dim = 1``, ``eta: float = 0.7``). Enum members are not:
a member is a singleton compared by identity, so a live process cannot take a new value for it.
Docstrings, annotations, decorators, ``raise`` arguments (error messages) and string constants are left
alone: mutating them changes no computed value.
"""

from __future__ import annotations

import ast
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["OPERATORS", "Mutant", "apply", "apply_in_place", "find_mutants", "module_bindings", "parsed"]

# one canonical replacement per operator: the classic one-token slips
_BINOP_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr, ast.MatMult: ast.Mult,
}
_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BOOL_SWAP: dict[type[ast.boolop], type[ast.boolop]] = {ast.And: ast.Or, ast.Or: ast.And}

OPERATORS: dict[str, str] = {
    "arith": "swap a binary operator (+ -, * /, // /, ** *, & |, << >>)",
    "augassign": "swap an augmented assignment (+= -=, *= /=, ...)",
    "compare": "swap a comparison (< <=, > >=, == !=, is / is not, in / not in)",
    "boolop": "swap and / or",
    "not": "drop a `not`",
    "negate": "negate the condition of an if / while / conditional expression",
    "unary_minus": "drop a unary minus",
    "const": "a number off by one (n -> n + 1), or True <-> False",
    "slice": "a slice bound off by one (lower + 1, upper - 1)",
    "drop_method": "drop a no-argument method call (x.float() -> x)",
    "drop_call": "remove a call statement",
    "return_none": "return None instead of the value",
}


@dataclass(frozen=True)
class Mutant:
    """One mutation of one module: where (file, line, walk index), what (operator, diff) and how to patch it.

    ``scope`` says how a live process takes the mutant: ``function`` (the code object of ``qualname``,
    the outermost enclosing function, is replaced), ``default`` (a default of function ``qualname`` is
    re-bound), ``class`` (class constant or field default ``qualname`` = ``Class.NAME`` is re-bound) or
    ``global`` (module constant ``qualname`` is rebound). ``span`` is the first and last line of the
    enclosing function or class (the lines whose tests may notice the mutant).
    """

    module: str
    file: str
    line: int
    index: int
    operator: str
    diff: str
    scope: str
    qualname: str
    span: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "span", tuple(self.span))  # a list after a JSON round trip

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}:{self.operator}:{self.index}"


@dataclass(frozen=True)
class _Site:
    index: int
    operator: str
    node: ast.AST
    scope: str
    qualname: str
    make: Callable[[ast.AST], ast.AST | None]
    span: tuple[int, int]


def module_bindings(body: list[ast.stmt]) -> list[tuple[str, ast.expr, ast.stmt]]:
    """``(name, value, statement)`` for every ``NAME = value``, ``NAME: T = value`` and ``A, B = a, b`` in
    ``body`` (a module's or a class's): the constants a mutant may rebind."""
    found = []
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                found.append((target.id, stmt.value, stmt))
            elif (isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple)
                  and len(target.elts) == len(stmt.value.elts) and all(isinstance(e, ast.Name) for e in target.elts)):
                found += [(e.id, v, stmt) for e, v in zip(target.elts, stmt.value.elts, strict=True)]
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            found.append((stmt.target.id, stmt.value, stmt))
    return found


def _enum(node: ast.ClassDef) -> bool:
    """A class whose base names an enum (``enum.IntEnum``, ``Enum``, ``Flag``...): its members are not rebound."""
    names = [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases]
    return any(name.endswith(("Enum", "Flag")) for name in names)


def _number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            and isinstance(parent, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))


def _swapped(node: ast.AST, table: dict, attr: str) -> Callable[[ast.AST], ast.AST | None]:
    def make(target: ast.AST) -> ast.AST | None:
        op = getattr(target, attr)
        setattr(target, attr, table[type(op)]())
        return target
    return make


def _swap_cmp(position: int) -> Callable[[ast.AST], ast.AST | None]:
    def make(target: ast.AST) -> ast.AST | None:
        target.ops[position] = _CMP_SWAP[type(target.ops[position])]()
        return target
    return make


def _plus(node: ast.expr, delta: int) -> ast.expr:
    op = ast.Add() if delta > 0 else ast.Sub()
    return ast.BinOp(left=node, op=op, right=ast.Constant(abs(delta)))


class _Finder(ast.NodeVisitor):
    """Collects mutation sites in walk order, tracking the outermost enclosing function."""

    def __init__(self) -> None:
        self.sites: list[_Site] = []
        self._counter = 0
        self._classes: list[str] = []
        self._function: str | None = None   # qualname of the outermost enclosing function
        self._binding: tuple[str, str] | None = None  # (scope, qualname) of a default or constant being walked
        self._span: tuple[int, int] = (0, 0)
        self._parents: list[ast.AST] = []

    # ------------------------------------------------------------------ scope tracking
    def _scope(self) -> tuple[str, str] | None:
        if self._function is not None:
            return "function", self._function
        return self._binding

    def _add(self, node: ast.AST, operator: str, make: Callable[[ast.AST], ast.AST | None]) -> None:
        scope = self._scope()
        if scope is None:
            return
        self.sites.append(_Site(self._counter, operator, node, scope[0], scope[1], make, self._span))
        self._counter += 1

    def _visit_bound(self, value: ast.AST, scope: str, qualname: str, span: tuple[int, int]) -> None:
        """Walk a default or a constant's value with its own scope (rebinding, not a code swap, applies it)."""
        saved = self._binding, self._span
        self._binding, self._span = (scope, qualname), span
        self.visit(value)
        self._binding, self._span = saved

    def generic_visit(self, node: ast.AST) -> None:
        self._parents.append(node)
        for child in ast.iter_child_nodes(node):
            if _docstring(child, node):
                continue
            self.visit(child)
        self._parents.pop()

    def visit_Module(self, node: ast.Module) -> None:
        self._parents.append(node)
        constants = {id(stmt): [(n, v) for n, v, s in module_bindings([stmt]) if _has_number(v)] for stmt in node.body}
        for stmt in node.body:
            if _docstring(stmt, node):
                continue
            if constants[id(stmt)]:
                for name, value in constants[id(stmt)]:
                    self._visit_bound(value, "global", name, (stmt.lineno, stmt.end_lineno or stmt.lineno))
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.visit(stmt)
        self._parents.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self._parents.append(node)
        constants = {} if self._function or _enum(node) else {
            id(stmt): [(n, v) for n, v, s in module_bindings([stmt]) if _has_number(v)] for stmt in node.body}
        for stmt in node.body:
            if constants.get(id(stmt)):
                for name, value in constants[id(stmt)]:
                    self._visit_bound(_field_default(value), "class", ".".join([*self._classes, name]),
                                      (node.lineno, node.end_lineno or node.lineno))
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or self._function:
                self.visit(stmt)
        self._parents.pop()
        self._classes.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self._function
        qualname = ".".join([*self._classes, node.name])
        span = (node.lineno, node.end_lineno or node.lineno)
        defaults = [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
        for default in defaults:  # decorators and annotations run at definition time: not mutated
            if outer is None:  # bound once, at import: the live function's defaults are rebound
                self._visit_bound(default, "default", qualname, span)
            else:  # evaluated each time the enclosing function runs: part of its code
                self.visit(default)
        saved_span = self._span
        if outer is None:
            self._function, self._span = qualname, span
        self._parents.append(node)
        for stmt in node.body:
            if _docstring(stmt, node):
                continue
            self.visit(stmt)
        self._parents.pop()
        self._function, self._span = outer, saved_span

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Lambda(self, node: ast.Lambda) -> None:
        if self._function is None:  # a module-level lambda is not a patchable function body here
            return
        self.generic_visit(node)

    # ------------------------------------------------------------------ skipped subtrees
    def visit_Raise(self, node: ast.Raise) -> None:
        return  # the message of an error; its condition lives in the enclosing `if`

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    # ------------------------------------------------------------------ operators
    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in _BINOP_SWAP and not _string_format(node):
            self._add(node, "arith", _swapped(node, _BINOP_SWAP, "op"))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if type(node.op) in _BINOP_SWAP:
            self._add(node, "augassign", _swapped(node, _BINOP_SWAP, "op"))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for position, op in enumerate(node.ops):
            if type(op) in _CMP_SWAP:
                self._add(node, "compare", _swap_cmp(position))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        self._add(node, "boolop", _swapped(node, _BOOL_SWAP, "op"))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add(node, "not", lambda target: target.operand)
        elif isinstance(node.op, ast.USub) and not _number(node.operand):
            self._add(node, "unary_minus", lambda target: target.operand)
        elif isinstance(node.op, ast.USub):  # -3 is one constant: off by one toward zero's other side
            self._add(node, "const", lambda target: ast.UnaryOp(op=ast.USub(), operand=_plus(target.operand, 1)))
            return
        self.generic_visit(node)

    def _negate_test(self, node: ast.If | ast.While | ast.IfExp) -> None:
        if _negation_covered(node.test):
            return
        def make(target: ast.AST) -> ast.AST | None:
            target.test = ast.UnaryOp(op=ast.Not(), operand=target.test)
            return target
        self._add(node, "negate", make)

    def visit_If(self, node: ast.If) -> None:
        self._negate_test(node)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._negate_test(node)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate_test(node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, bool):
            self._add(node, "const", lambda target: ast.Constant(not target.value))
        elif type(node.value) in (int, float):
            self._add(node, "const", lambda target: ast.Constant(target.value + 1))

    def visit_Slice(self, node: ast.Slice) -> None:
        if node.lower is not None:
            def lower(target: ast.AST) -> ast.AST | None:
                target.lower = _plus(target.lower, 1)
                return target
            self._add(node, "slice", lower)
        if node.upper is not None:
            def upper(target: ast.AST) -> ast.AST | None:
                target.upper = _plus(target.upper, -1)
                return target
            self._add(node, "slice", upper)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and not node.args and not node.keywords and _method_droppable(func.attr):
            self._add(node, "drop_method", lambda target: target.func.value)
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call):
            self._add(node, "drop_call", lambda target: ast.Pass())
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            def make(target: ast.AST) -> ast.AST | None:
                target.value = None
                return target
            self._add(node, "return_none", make)
        self.generic_visit(node)


# method calls whose removal changes what is computed (dtype, copy, layout, aliasing, sync), not lookups.
# Not `.cpu()`: the score is measured on the CPU tier, where `.cpu()` returns the very tensor it is called on,
# so dropping it is equivalent by construction there (the gpu tier is what meets a CUDA tensor).
_DROPPABLE = {
    "float", "double", "half", "bfloat16", "long", "int", "bool", "clone", "contiguous", "detach",
    "item", "tolist", "squeeze", "flatten", "t", "sort", "reverse", "copy", "numpy", "abs", "exp", "log",
    "sqrt", "neg", "sum", "mean", "max", "min", "any", "all", "argmax", "cumsum", "wait", "barrier",
}


def _field_default(value: ast.expr) -> ast.expr:
    """What of a class-level value a live process can take: of ``field(default=..., compare=False, ...)`` only the
    default. The other arguments (compare, hash, init, repr, kw_only) were read once, when ``dataclass`` generated
    the class's methods, so rebinding them changes nothing and their mutants would be judged without being applied."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
        default = next((k.value for k in value.keywords if k.arg == "default"), None)
        return default if default is not None else ast.Constant(None)
    return value


def _has_number(node: ast.AST) -> bool:
    """A value with a number or a bool in it: a constant a one-token slip can change."""
    return any(isinstance(n, ast.Constant) and type(n.value) in (int, float, bool) for n in ast.walk(node))


def _negation_covered(test: ast.expr) -> bool:
    """True when another operator already yields ``not test`` (drop the `not`, or swap ==, is, in)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq | ast.NotEq | ast.Is | ast.IsNot | ast.In | ast.NotIn))


def _method_droppable(name: str) -> bool:
    return name in _DROPPABLE


def _string_format(node: ast.BinOp) -> bool:
    return isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)


def _sites(tree: ast.Module) -> list[_Site]:
    finder = _Finder()
    finder.visit(tree)
    return finder.sites


def _replace(tree: ast.Module, index: int) -> tuple[ast.Module, _Site, ast.AST]:
    """A deep copy of ``tree`` with site ``index`` mutated; also the original node and the new one."""
    mutated = copy.deepcopy(tree)
    sites = _sites(mutated)
    site = sites[index]
    original = copy.deepcopy(site.node)
    new = site.make(site.node)
    if new is not site.node:
        _swap_child(mutated, site.node, new)
    ast.fix_missing_locations(mutated)
    return mutated, site, original


def _swap_child(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                ast.copy_location(new, old)
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for position, item in enumerate(value):
                    if item is old:
                        ast.copy_location(new, old)
                        value[position] = new
                        return
    raise LookupError("mutation site not found in its tree")


def _diff(lines: list[str], original: ast.AST, new: ast.AST) -> str:
    """The mutated source line(s) as ``-old`` / ``+new`` text (the node's own text swapped in place)."""
    first, last = original.lineno, original.end_lineno or original.lineno
    before = lines[first - 1:last]
    replacement = "pass" if isinstance(new, ast.Pass) else ast.unparse(new)
    if isinstance(new, ast.expr) and not isinstance(new, ast.Name | ast.Constant | ast.Attribute | ast.Call):
        replacement = f"({replacement})" if isinstance(original, ast.expr) and _needs_parens(new) else replacement
    head = before[0][:original.col_offset]
    tail = before[-1][original.end_col_offset:]
    after = head + replacement + tail
    old = " ".join(part.strip() for part in before)
    return f"- {old}\n+ {after.strip()}"


def _needs_parens(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp | ast.BoolOp | ast.Compare | ast.IfExp | ast.UnaryOp)


def find_mutants(source: str, *, module: str, file: str) -> list[Mutant]:
    """Every mutant of ``source`` (module ``module`` at repo path ``file``), in walk order."""
    tree = ast.parse(source, filename=file)
    lines = source.splitlines()
    mutants = []
    for site in _sites(tree):
        probe = copy.deepcopy(site.node)
        new = site.make(probe)
        if new is None:
            continue
        if isinstance(site.node, ast.If | ast.While | ast.IfExp):  # show the condition, not the whole block
            diff = _diff(lines, site.node.test, new.test)
        else:
            diff = _diff(lines, site.node, new)
        mutants.append(Mutant(module=module, file=file, line=site.node.lineno, index=site.index,
                              operator=site.operator, diff=diff, scope=site.scope, qualname=site.qualname,
                              span=site.span))
    return mutants


def apply(source: str, mutant: Mutant) -> ast.Module:
    """The module tree of ``source`` with ``mutant`` applied (compile it with the module's file name)."""
    tree = ast.parse(source, filename=mutant.file)
    mutated, site, _ = _replace(tree, mutant.index)
    _check(site, mutant)
    return mutated


@functools.cache
def parsed(source: str, file: str) -> tuple[ast.Module, list[_Site]]:
    """The tree of ``source`` and its sites, once per process: the runner fills it before it forks, so a child
    starts from it instead of parsing and walking the module again."""
    tree = ast.parse(source, filename=file)
    return tree, _sites(tree)


def apply_in_place(source: str, mutant: Mutant) -> ast.Module:
    """``apply`` without the copy: the cached tree of ``parsed`` itself is mutated and returned. Only for a
    process that exits after using it (a forked mutant child), which never reads the cache again."""
    tree, sites = parsed(source, mutant.file)
    site = sites[mutant.index]
    _check(site, mutant)
    new = site.make(site.node)
    if new is not site.node:
        _swap_child(tree, site.node, new)
    ast.fix_missing_locations(tree)
    return tree


def _check(site: _Site, mutant: Mutant) -> None:
    if site.operator != mutant.operator or site.node.lineno != mutant.line:
        raise ValueError(f"source changed since mutant {mutant.key} was found (site {site.index} is now "
                         f"{site.operator} at line {site.node.lineno})")
