"""The mutation engine's own tests, on a tiny synthetic module (no torch, no worlds): fast."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mutation.engine import cli, report
from mutation.engine.coverage_map import CoverageMap
from mutation.engine.operators import OPERATORS, Mutant, apply, find_mutants
from mutation.engine.patching import PatchError, patch_live

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]

DEMO = textwrap.dedent('''
    """A demo module."""
    LIMIT = 3


    def add(a, b):
        """Docstrings are never mutated."""
        return a + b


    def spin(n):
        i = 0
        while i < n:
            i += 1
        return i


    def pick(xs, flag):
        if not flag:
            return xs[1:3]
        out = [x for x in xs if x > 0 and x != 2]
        out.sort()
        return -out[0] if flag is True else LIMIT


    def check(x):
        if x < 0:
            raise ValueError(f"x must be >= 0, got {x - 1}")
        return x
''')


def _mutants() -> list[Mutant]:
    return find_mutants(DEMO, module="mutdemo", file="mutdemo.py")


def _one(operator: str, needle: str) -> Mutant:
    found = [m for m in _mutants() if m.operator == operator and needle in m.diff.split("\n")[1]]
    assert found, f"no {operator} mutant with {needle!r} in: {[m.diff for m in _mutants()]}"
    return found[0]


@pytest.mark.parametrize(("operator", "new_line"), [
    ("arith", "+ return (a - b)"),
    ("augassign", "+ i -= 1"),
    ("compare", "+ while (i <= n):"),
    ("boolop", "+ out = [x for x in xs if (x > 0 or x != 2)]"),
    ("not", "+ if flag:"),
    ("negate", "+ while (not i < n):"),
    ("unary_minus", "+ return out[0] if flag is True else LIMIT"),
    ("const", "+ i = 1"),
    ("slice", "+ return xs[1 + 1:3]"),
    ("slice", "+ return xs[1:3 - 1]"),
    ("drop_call", "+ pass"),
    ("return_none", "+ return"),
    ("const", "+ LIMIT = 4"),
])
def test_each_operator_yields_its_mutant(operator, new_line):
    assert operator in OPERATORS
    mutant = _one(operator, new_line[2:])
    assert mutant.diff.split("\n")[1] == new_line


def test_docstrings_and_error_messages_are_not_mutated():
    diffs = "\n".join(m.diff for m in _mutants())
    assert "Docstrings" not in diffs and "must be" not in diffs
    assert all(m.line != 28 for m in _mutants())  # the raise line


def test_mutants_are_deterministic_and_scoped():
    assert _mutants() == _mutants()
    assert {m.scope for m in _mutants()} == {"function", "global"}
    assert _one("const", "LIMIT = 4").qualname == "LIMIT"
    assert _one("arith", "a - b").qualname == "add"


def test_apply_refuses_a_changed_source():
    mutant = _one("arith", "a - b")
    with pytest.raises(ValueError, match="source changed"):
        apply(DEMO.replace("a + b", "a"), mutant)


@pytest.fixture
def demo_module(tmp_path, monkeypatch):
    (tmp_path / "mutdemo.py").write_text(DEMO)
    (tmp_path / "mutuser.py").write_text("from mutdemo import LIMIT, add\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mutdemo", "mutuser"):
        sys.modules.pop(name, None)
    yield importlib.import_module("mutdemo"), importlib.import_module("mutuser")
    for name in ("mutdemo", "mutuser"):
        sys.modules.pop(name, None)


def test_patch_live_changes_every_reference(demo_module):
    demo, user = demo_module
    mutant = find_mutants(DEMO, module="mutdemo", file=demo.__file__)
    arith = next(m for m in mutant if m.operator == "arith" and "a - b" in m.diff)
    patch_live(arith, roots=("mutdemo", "mutuser"))
    assert demo.add(5, 3) == 2 and user.add(5, 3) == 2  # the imported name runs the mutant too
    limit = next(m for m in mutant if m.operator == "const" and "LIMIT = 4" in m.diff)
    patch_live(limit, roots=("mutdemo", "mutuser"))
    assert demo.LIMIT == 4 and user.LIMIT == 4 and demo.pick([5, 1], flag=1) == 4


def test_patch_live_names_a_missing_function(demo_module):
    demo, _ = demo_module
    mutant = next(m for m in find_mutants(DEMO, module="mutdemo", file=demo.__file__) if m.qualname == "add")
    ghost = Mutant(**{**mutant.__dict__, "qualname": "nowhere"})
    with pytest.raises(PatchError, match="nowhere"):
        patch_live(ghost, roots=("mutdemo",))


def _map() -> CoverageMap:
    return CoverageMap(lines={"m.py": {3: ["t.py::slow", "t.py::fast", "u.py::mid"], 9: ["t.py::fast"]}},
                       caches={"m.py": {3: ["cache:a"]}}, cache_users={"cache:a": ["cache:b", "t.py::fast"],
                                                                        "cache:b": ["u.py::mid"]},
                       durations={"t.py::slow": 4.0, "t.py::fast": 0.1, "u.py::mid": 1.0}, failing=[],
                       seconds=1.0)


def test_selection_is_fastest_first_and_covers_globals_by_use():
    base = Mutant("m", "m.py", 3, 0, "arith", "- a\n+ b", "function", "f")
    assert cli.select_tests(base, _map(), {}) == ["t.py::fast", "u.py::mid", "t.py::slow"]
    constant = Mutant("m", "m.py", 1, 0, "const", "- K = 1\n+ K = 2", "global", "K")
    assert cli.select_tests(constant, _map(), {"m.py": ["K = 1", "", "", "", "", "", "", "", "y = K"]}) == [
        "t.py::fast"]
    assert _map().stale_caches("m.py", 3) == ["cache:a", "cache:b"]


def test_selection_reaches_the_unit_test_of_a_line_every_end_to_end_test_runs(monkeypatch):
    e2e = [f"e{k}.py::run" for k in range(6)]
    lines = {"m.py": {3: [*e2e, "test_m.py::unit"], 4: ["test_m.py::unit"]},
             "other.py": {n: e2e for n in range(1, 30)}}
    durations = {**{t: 0.01 for t in e2e}, "test_m.py::unit": 0.5}
    coverage_map = CoverageMap(lines=lines, caches={}, cache_users={}, durations=durations, failing=[], seconds=1.0)
    assert coverage_map.focus("test_m.py::unit", "m.py") == 1.0
    assert coverage_map.focus("e0.py::run", "m.py") == 1 / 30
    monkeypatch.setattr(cli, "MAX_TESTS", 3)
    monkeypatch.setattr(cli, "FOCUSED_TESTS", 1)
    chosen = cli.select_tests(Mutant("m", "m.py", 3, 0, "arith", "- a\n+ b", "function", "f"), coverage_map, {})
    assert chosen == ["e0.py::run", "e1.py::run", "test_m.py::unit"]  # run fastest first


def test_sample_is_seeded_and_stratified():
    population = [(group, Mutant(f"{group}.{k}", f"{group}/{k}.py", n, n, "const", "-\n+", "function", "f"))
                  for group in ("replay", "ar", "decode") for k in range(3) for n in range(20)]
    first = cli.sample(population, 40, seed=0)
    assert first == cli.sample(population, 40, seed=0) and first != cli.sample(population, 40, seed=1)
    assert len(first) == 40
    per_group = {g: sum(1 for gg, _ in first if gg == g) for g in ("replay", "ar", "decode")}
    assert sorted(per_group.values()) == [13, 13, 14]
    assert len({m.file for _, m in first}) == 9  # every module is drawn from


def test_report_shape_and_score_exclude_equivalents():
    rows = [{"file": "m.py", "line": i, "operator": "arith", "diff": f"- {i}\n+ x", "status": status,
             "killed_by": ["t::a"] if status == "killed" else []}
            for i, status in enumerate(["killed"] * 6 + ["survived", "timeout", "equivalent", "equivalent"])]
    doc = report.document(rows)
    assert list(doc) == ["score", "killed", "survived", "timeout", "equivalent", "mutants"]
    assert (doc["killed"], doc["survived"], doc["timeout"], doc["equivalent"]) == (6, 1, 1, 2)
    assert doc["score"] == 0.75
    assert set(doc["mutants"][0]) == {"file", "line", "operator", "diff", "status", "killed_by"}
    text = report.markdown(doc, title="t", notes=["n"])
    assert "excluded from the score" in text and "`m.py:6` arith" in text


def test_equivalents_file_is_reviewed():
    entries = cli.load_equivalents(cli.EQUIVALENTS)
    assert all(e["reason"].strip() for e in entries)
    mutant = Mutant("m", "m.py", 1, 0, "const", "- a = 1\n+ a = 2", "function", "f")
    assert cli.is_equivalent(mutant, [{"file": "m.py", "operator": "const", "diff": "- a = 1\n+ a = 2",
                                       "reason": "r"}])


def test_runner_reports_killed_survived_and_timeout(tmp_path):
    (tmp_path / "mutdemo.py").write_text(DEMO)
    (tmp_path / "test_demo.py").write_text(textwrap.dedent('''
        import mutdemo

        def test_add():
            assert mutdemo.add(2, 3) == 5

        def test_spin_runs():
            mutdemo.spin(3)
    '''))
    mutants = find_mutants(DEMO, module="mutdemo", file=str(tmp_path / "mutdemo.py"))
    chosen = {"killed": next(m for m in mutants if "a - b" in m.diff),
              "survived": next(m for m in mutants if m.operator == "return_none" and m.qualname == "spin"),
              "timeout": next(m for m in mutants if m.operator == "augassign")}
    tests = {"killed": ["test_demo.py::test_add"], "survived": ["test_demo.py::test_spin_runs"],
             "timeout": ["test_demo.py::test_spin_runs"]}
    jobs = [{"id": i, "mutant": m.__dict__, "tests": tests[name], "timeout": 1.0 if name == "timeout" else 30.0}
            for i, (name, m) in enumerate(chosen.items())]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run([sys.executable, "-m", "mutation.engine.runner", "jobs.json", "out.jsonl", "2", "mutdemo",
                           "--", "-q", "-p", "no:cacheprovider", "test_demo.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert proc.returncode == 0, proc.stderr
    statuses = {name: records[i]["status"] for i, name in enumerate(chosen)}
    assert statuses == {"killed": "killed", "survived": "survived", "timeout": "timeout"}
    assert records[0]["killed_by"] == ["test_demo.py::test_add"]


DEFAULTS = textwrap.dedent('''
    STEP = 2


    def jump(x, by=STEP, other=STEP + 0):
        return x + by + other


    class Walker:
        def walk(self, x, *, by=STEP):
            return x + by
''')


def test_a_module_constant_reaches_the_defaults_bound_at_import(tmp_path, monkeypatch):
    (tmp_path / "mutdefaults.py").write_text(DEFAULTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mutdefaults", None)
    module = importlib.import_module("mutdefaults")
    try:
        step = next(m for m in find_mutants(DEFAULTS, module="mutdefaults", file=module.__file__)
                    if m.scope == "global" and m.diff.endswith("STEP = 3"))
        patch_live(step, roots=("mutdefaults",))
        assert module.STEP == 3
        assert module.jump(0) == 3 + 2  # `by=STEP` follows the mutant; `STEP + 0` is an expression, left as bound
        assert module.Walker().walk(0) == 3
    finally:
        sys.modules.pop("mutdefaults", None)


def test_a_module_constant_is_tested_by_the_test_files_that_name_it(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "REPO", tmp_path)
    cli._test_file_text.cache_clear()
    (tmp_path / "test_a.py").write_text("from m import SEED_CALLS\n")
    (tmp_path / "test_b.py").write_text("SEED_CALLS_EXTRA = 1\n")
    coverage_map = CoverageMap(lines={"m.py": {}}, caches={}, cache_users={},
                               durations={"test_a.py::t": 0.1, "test_b.py::t": 0.1}, failing=[], seconds=1.0)
    constant = Mutant("m", "m.py", 1, 0, "const", "- SEED_CALLS = 1\n+ SEED_CALLS = 2", "global", "SEED_CALLS")
    try:
        assert cli.select_tests(constant, coverage_map, {"m.py": ["SEED_CALLS = 1"]}) == ["test_a.py::t"]
    finally:
        cli._test_file_text.cache_clear()
