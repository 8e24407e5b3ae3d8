"""The mutation engine's own tests, on a tiny synthetic module (no torch, no worlds): fast."""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from collections import Counter
from pathlib import Path

import pytest

from tools.mutation_score import cli, covplugin, equivalents, report
from tools.mutation_score import coverage_map as covmap
from tools.mutation_score.coverage_map import CoverageMap
from tools.mutation_score.operators import OPERATORS, Mutant, apply, find_mutants
from tools.mutation_score.patching import PatchError, patch_live

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


def test_a_field_default_is_tested_by_every_test_that_constructs_its_class():
    source = {"m.py": ["@dataclass(frozen=True)", "class Record:", "    path: str",
                       "    config: dict = field(default_factory=dict, compare=False)", "",
                       "def detect(path):", "    return Record(path)", "", "def label(r):", "    return r.config",
                       "", "def mark(p):", "    return Record(p, config={})"]}
    lines = {"m.py": {7: ["t.py::detects"], 10: ["t.py::labels"], 13: ["t.py::marks"]}}
    coverage_map = CoverageMap(lines=lines, caches={}, cache_users={}, durations={
        "t.py::detects": 0.1, "t.py::labels": 0.1, "t.py::marks": 0.1}, failing=[], seconds=1.0)
    field_default = Mutant("m", "m.py", 4, 0, "const", "- compare=False\n+ compare=True", "class", "Record.config",
                           (2, 4))
    assert cli.covering_tests(field_default, coverage_map, source) == {"t.py::detects", "t.py::labels", "t.py::marks"}


def test_a_field_default_is_tested_by_a_test_file_that_builds_its_class_itself(monkeypatch):
    """Instances built at import (a table of them) run no line under a test: a test constructing its own instance
    is what notices a mutated default, and only its file says so."""
    source = {"m.py": ["@dataclass(frozen=True)", "class Axis:", "    name: str", "    subject: bool = False", "",
                       "TABLE = {'a': Axis('a')}"]}
    coverage_map = CoverageMap(lines={}, caches={}, cache_users={}, durations={
        "test_axis.py::builds": 0.1, "test_other.py::unrelated": 0.1}, failing=[], seconds=1.0)
    texts = {"test_axis.py": "assert not m.Axis('b').subject", "test_other.py": "assert m.TABLE"}
    monkeypatch.setattr(cli, "_test_file_text", lambda path: texts[path])
    default = Mutant("m", "m.py", 4, 0, "const", "- subject: bool = False\n+ subject: bool = True", "class",
                     "Axis.subject", (2, 4))
    assert cli.covering_tests(default, coverage_map, source) == {"test_axis.py::builds"}


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


def test_a_focused_test_over_the_budget_on_its_own_leaves_the_first_pass_to_the_fast_ones(monkeypatch):
    lines = {"m.py": {3: ["test_m.py::property", "e.py::a", "e.py::b"]}}
    durations = {"test_m.py::property": 6.5, "e.py::a": 0.1, "e.py::b": 0.2}
    coverage_map = CoverageMap(lines=lines, caches={}, cache_users={}, durations=durations, failing=[], seconds=1.0)
    monkeypatch.setattr(cli, "TEST_BUDGET_S", 6.0)
    mutant = Mutant("m", "m.py", 3, 0, "arith", "- a\n+ b", "function", "f")
    assert coverage_map.focus("test_m.py::property", "m.py") >= coverage_map.focus("e.py::a", "m.py")
    assert cli.select_tests(mutant, coverage_map, {}) == ["e.py::a", "e.py::b"]  # the slow one waits for pass 2
    alone = CoverageMap(lines={"m.py": {3: ["test_m.py::property", "f.py::c"]}}, caches={}, cache_users={},
                        durations={"test_m.py::property": 6.5, "f.py::c": 7.0}, failing=[], seconds=1.0)
    assert cli.select_tests(mutant, alone, {}) == ["test_m.py::property"]  # all over: the fastest of them


def _population(sizes: dict[str, int]) -> list[tuple[str, Mutant]]:
    return [(file.split("/")[0], Mutant(file, file, n, n, "const", "-\n+", "function", "f"))
            for file, size in sizes.items() for n in range(size)]


def test_sample_is_seeded_and_proportional_to_each_modules_mutants():
    sizes = {"replay/a.py": 300, "replay/b.py": 20, "ar/c.py": 100, "ar/d.py": 60, "decode/e.py": 20}
    population = _population(sizes)
    first = cli.sample(population, 50, seed=0)
    assert first == cli.sample(population, 50, seed=0) and first != cli.sample(population, 50, seed=1)
    assert len(first) == 50 and len({m for _, m in first}) == 50
    for seed in range(20):  # every module gets floor or ceil of its share, whatever the seed
        drawn = Counter(m.file for _, m in cli.sample(population, 50, seed=seed))
        for file, size in sizes.items():
            share = 50 * size / 500
            assert math.floor(share) <= drawn[file] <= math.ceil(share), (seed, file, drawn)
    assert cli.sample(population, 600, seed=0) == population  # a sample larger than the population is all of it


def test_sample_draws_every_mutant_with_the_same_probability():
    population = _population({"p/big.py": 40, "p/small.py": 3, "q/one.py": 1, "q/mid.py": 16})
    hits = Counter(m for seed in range(3000) for _, m in cli.sample(population, 6, seed=seed))
    rates = [hits[m] / 3000 for _, m in population]
    assert min(rates) > 0.07 and max(rates) < 0.13  # 6 / 60 = 0.1 for each: no module always in or out


def test_the_sample_seed_comes_from_the_commit(monkeypatch, tmp_path):
    args = argparse.Namespace(seed=None, seed_from=None)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        seed, origin = cli.sample_seed(args, [])
        assert seed == cli.derive_seed(head.stdout.strip()) and head.stdout.strip()[:12] in origin
    explicit, origin = cli.sample_seed(argparse.Namespace(seed=None, seed_from="ab12" * 10), [])
    assert explicit == cli.derive_seed("ab12" * 10) != cli.derive_seed("ab13" * 10) and "--seed-from" in origin
    assert cli.sample_seed(argparse.Namespace(seed=7, seed_from=None), [])[0] == 7
    source = tmp_path / "m.py"
    source.write_text("X = 1\n")
    monkeypatch.setattr(cli, "REPO", tmp_path)  # not a git checkout: the sources' hash seeds the sample
    seed, origin = cli.sample_seed(args, [source])
    assert "not a git checkout" in origin and seed == cli.derive_seed(hashlib.sha256(b"X = 1\n").hexdigest())
    source.write_text("X = 2\n")
    assert cli.sample_seed(args, [source])[0] != seed


def test_report_shape_and_score_exclude_equivalents():
    rows = [{"file": "m.py", "line": i, "operator": "arith", "diff": f"- {i}\n+ x", "status": status,
             "killed_by": ["t::a"] if status == "killed" else []}
            for i, status in enumerate(["killed"] * 6 + ["survived", "timeout", "equivalent", "equivalent"])]
    rows.append({"file": "m.py", "line": 20, "function": "g", "operator": "drop_call", "diff": "- f()\n+ pass",
                 "status": "error", "killed_by": [], "error": "PatchError: no live function"})
    doc = report.document(rows)
    assert list(doc) == ["score", "killed", "survived", "timeout", "equivalent", "errors", "mutants"]
    assert (doc["killed"], doc["survived"], doc["timeout"], doc["equivalent"], doc["errors"]) == (6, 1, 1, 2, 1)
    assert doc["score"] == 0.75  # an error is not in the score: it is counted apart and gates the run
    assert set(doc["mutants"][0]) == {"file", "line", "function", "operator", "diff", "status", "killed_by"}
    assert doc["mutants"][-1]["error"] == "PatchError: no live function"
    text = report.markdown(doc, title="t", notes=["n"])
    assert "excluded from the score" in text and "`m.py:6` arith" in text
    assert "## Error (1)" in text and "`m.py:20` in `g` drop_call" in text and "1 could not be applied" in text


TWINS = textwrap.dedent('''
    def first(x):
        y = x.detach().double()
        return y


    def second(x):
        y = x.detach().double()
        return y
''')


def _entry(**changes: str) -> equivalents.Equivalent:
    fields = {"file": "twins.py", "function": "first", "operator": "drop_method",
              "line": "y = x.detach().double()", "mutant": "y = x.double()", "reason": "detach drops only history"}
    return equivalents.Equivalent(**{**fields, **changes})


def test_an_equivalence_entry_covers_its_own_site_only():
    mutants = find_mutants(TWINS, module="twins", file="twins.py")
    covered, stale = equivalents.match(mutants, [_entry()], {"twins.py"})
    assert stale == [] and [m.qualname for m in covered] == ["first"]  # the copy in `second` is still judged
    spaced = _entry(line="y  =  x.detach().double()   # reviewed", mutant="y = x.double()")
    assert equivalents.match(mutants, [spaced], {"twins.py"})[0]  # whitespace and comments are not code


def test_an_equivalence_entry_whose_line_changed_or_was_copied_is_stale():
    changed = find_mutants(TWINS.replace("y = x.detach().double()\n    return y\n\n\ndef second",
                                         "y = x.detach().float()\n    return y\n\n\ndef second"),
                           module="twins", file="twins.py")
    covered, stale = equivalents.match(changed, [_entry()], {"twins.py"})
    assert covered == {} and stale == [(_entry(), 0)]
    copied = find_mutants(TWINS.replace("    return y\n\n\ndef second", "    y = x.detach().double()\n    return y"
                                        "\n\n\ndef second", 1), module="twins", file="twins.py")
    covered, stale = equivalents.match(copied, [_entry()], {"twins.py"})
    assert covered == {} and stale == [(_entry(), 2)]  # a copy inside the function needs its own review
    assert equivalents.match(copied, [_entry(count=2)], {"twins.py"})[1] == []
    assert equivalents.match(changed, [_entry()], {"other.py"}) == ({}, [])  # only the mutated files are checked


def test_a_malformed_equivalence_entry_is_a_usage_error_naming_it(tmp_path):
    bad = tmp_path / "eq.toml"
    bad.write_text('[[mutant]]\nfile = "m.py"\noperator = "const"\ndiff = "- a\\n+ b"\nreason = "r"\n')
    with pytest.raises(SystemExit, match=r"entry 1 \(m.py\).*missing or empty: \['function', 'line', 'mutant'\]"):
        equivalents.load(bad)
    bad.write_text("[[mutant]\n")
    with pytest.raises(SystemExit, match="not valid TOML"):
        equivalents.load(bad)


def test_the_reviewed_equivalents_match_the_code_as_it_is():
    entries = equivalents.load(cli.EQUIVALENTS)
    assert entries and all(e.reason.strip() for e in entries)
    files = sorted({e.file for e in entries})
    mutants = [m for f in files for m in find_mutants((REPO / f).read_text(), module=f, file=f)]
    covered, stale = equivalents.match(mutants, entries, set(files))
    assert [e.describe() for e, _ in stale] == []  # a reviewed line changed: review the entry again
    assert len(covered) == sum(e.count for e in entries)


DEMO_TESTS = textwrap.dedent('''
    import os
    import time
    from pathlib import Path

    import mutdemo

    def test_add():
        assert mutdemo.add(2, 3) == 5

    def test_spin_runs():
        mutdemo.spin(3)

    def test_slow():
        Path("started").write_text(str(os.getpid()))
        time.sleep(60)

    def test_slow_the_first_time():
        if not Path("slowed").exists():  # a load spike: only the first run of it is slow
            Path("slowed").write_text("")
            time.sleep(30)
        assert mutdemo.add(2, 3) == 5

    def test_leaves_state():
        mutdemo.LEFT = True

    def test_breaks_after_the_one_that_leaves_state():
        assert not getattr(mutdemo, "LEFT", False)
''')


def _demo(tmp_path: Path) -> tuple[dict[str, str], dict[str, Mutant]]:
    (tmp_path / "mutdemo.py").write_text(DEMO)
    (tmp_path / "test_demo.py").write_text(DEMO_TESTS)
    (tmp_path / "scratch").mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", TMPDIR=str(tmp_path / "scratch"))
    mutants = find_mutants(DEMO, module="mutdemo", file=str(tmp_path / "mutdemo.py"))
    chosen = {"add": next(m for m in mutants if "a - b" in m.diff),
              "spin": next(m for m in mutants if m.operator == "return_none" and m.qualname == "spin"),
              "loop": next(m for m in mutants if m.operator == "augassign")}
    return env, chosen


def _runner(tmp_path: Path, jobs: list[dict], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "jobs.json").write_text(json.dumps([dict(j, mutant=j["mutant"].__dict__) for j in jobs]))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tools.mutation_score.runner", "jobs.json", str(out), "2", "mutdemo",
                             "--", "-q", "-p", "no:cacheprovider", "test_demo.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def _records(out: Path) -> dict[int, dict]:
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_runner_reports_killed_survived_and_timeout_and_leaves_nothing_behind(tmp_path):
    env, chosen = _demo(tmp_path)
    tests = {"add": ["test_demo.py::test_add"], "spin": ["test_demo.py::test_spin_runs"],
             "loop": ["test_demo.py::test_spin_runs"]}
    jobs = [{"id": i, "mutant": m, "tests": tests[name], "timeout": 1.0 if name == "loop" else 30.0}
            for i, (name, m) in enumerate(chosen.items())]
    proc, out = _runner(tmp_path, jobs, env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = _records(out)
    assert [records[i]["status"] for i in range(3)] == ["killed", "survived", "timeout"]
    assert records[0]["killed_by"] == ["test_demo.py::test_add"]
    assert records[2]["timed_out_once_s"] >= 1.0  # a deadline passed twice, the second at TIMEOUT_RETRY x the first
    assert "timed_out_once_s" not in records[0] and "timed_out_once_s" not in records[1]
    assert list((tmp_path / "scratch").iterdir()) == []  # no mutrun-* folder outlives the run


def test_a_job_past_its_deadline_once_runs_again_at_a_longer_one(tmp_path):
    """One slow run (another process took the cores) is no verdict: the second run, at a longer deadline, is."""
    env, chosen = _demo(tmp_path)
    jobs = [{"id": 0, "mutant": chosen["add"], "tests": ["test_demo.py::test_slow_the_first_time"], "timeout": 2.0}]
    proc, out = _runner(tmp_path, jobs, env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    (record,) = _records(out).values()
    assert record["status"] == "killed" and record["timed_out_once_s"] >= 2.0, record
    assert "job 0 passed its 2 s deadline; running it again at 3 x" in stderr
    assert list((tmp_path / "scratch").iterdir()) == []  # no mutrun-* folder outlives the run


def test_a_run_past_its_time_limit_starts_no_more_mutants_and_says_how_many(tmp_path):
    env, chosen = _demo(tmp_path)
    jobs = [{"id": i, "mutant": chosen[name], "tests": ["test_demo.py::test_add"], "timeout": 30.0}
            for i, name in enumerate(("add", "spin"))]
    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": [dict(j, mutant=j["mutant"].__dict__) for j in jobs],
                                                    "stop_at": 0.0}))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tools.mutation_score.runner", "jobs.json", str(out), "2", "mutdemo",
                           "--", "-q", "-p", "no:cacheprovider", "test_demo.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "runner: time limit reached, 2 mutants not run" in proc.stderr
    assert not out.exists() or out.read_text() == ""


def test_a_first_pass_survivor_runs_against_all_its_covering_tests(tmp_path):
    env, chosen = _demo(tmp_path)
    first = ["test_demo.py::test_spin_runs"]  # runs `add`'s module but never checks it
    jobs = [{"id": 0, "mutant": chosen["add"], "tests": first, "timeout": 30.0,
             "more": ["test_demo.py::test_add"], "more_timeout": 30.0},
            {"id": 1, "mutant": chosen["spin"], "tests": first, "timeout": 30.0,
             "more": ["test_demo.py::test_add"], "more_timeout": 30.0}]
    proc, out = _runner(tmp_path, jobs, env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = _records(out)
    assert (records[0]["status"], records[0]["pass"], records[0]["killed_by"]) == (
        "killed", 2, ["test_demo.py::test_add"])  # the capped pass missed it; the full pass did not
    assert (records[1]["status"], records[1]["pass"], records[1]["tests"]) == ("survived", 2, 2)


def test_likely_killers_run_first_and_a_second_pass_also_puts_the_modules_killers_ahead(tmp_path):
    from tools.mutation_score.runner import MutantRunner

    runner = MutantRunner([], tmp_path / "out.jsonl", 1, ("mutdemo",))
    runner.killers = {("m.py", "f"): {"t_f": 1}, ("m.py", "g"): {"t_g": 3, "t_g2": 1}, ("n.py", "f"): {"t_n": 9}}
    mutant = {"file": "m.py", "qualname": "f"}
    tests = ["t_fast", "t_g2", "t_n", "t_g", "t_f"]  # fastest first, as selected
    first = runner._ordered({"mutant": mutant, "tests": tests})
    assert first["tests"] == ["t_f", "t_fast", "t_g2", "t_n", "t_g"]  # only the function's own killer moves
    second = runner._ordered({"mutant": mutant, "tests": tests, "full": True})
    assert second["tests"] == ["t_f", "t_g", "t_g2", "t_fast", "t_n"]  # then the module's, most kills first


def test_a_test_that_fails_for_what_an_earlier_one_left_behind_kills_nothing(tmp_path):
    env, chosen = _demo(tmp_path)
    leaks = ["test_demo.py::test_leaves_state", "test_demo.py::test_breaks_after_the_one_that_leaves_state"]
    jobs = [{"id": 0, "mutant": chosen["spin"], "tests": leaks, "timeout": 30.0},  # neither test reads spin
            {"id": 1, "mutant": chosen["add"], "tests": [leaks[0], "test_demo.py::test_add"], "timeout": 30.0}]
    proc, out = _runner(tmp_path, jobs, env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = _records(out)
    assert (records[0]["status"], records[0]["killed_by"]) == ("survived", [])  # it fails unmutated in that order
    assert records[1]["killed_by"] == ["test_demo.py::test_add"]  # a kill after another test still counts


def _gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, proc: subprocess.Popen) -> int:
    for _ in range(600):
        if path.is_file() and path.read_text():
            return int(path.read_text())
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_an_interrupted_runner_kills_its_children_and_removes_its_folder(tmp_path):
    env, chosen = _demo(tmp_path)
    jobs = [{"id": 0, "mutant": chosen["add"], "tests": ["test_demo.py::test_slow"], "timeout": 120.0}]
    proc, _ = _runner(tmp_path, jobs, env)
    child = _wait_for(tmp_path / "started", proc)
    assert [p.name[:7] for p in (tmp_path / "scratch").iterdir()] == ["mutrun-"]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode != 0 and _gone(child)
    assert list((tmp_path / "scratch").iterdir()) == []


DRIVER = textwrap.dedent('''
    import json, signal, sys
    from pathlib import Path
    from tools.mutation_score import cli

    cli.REPO = Path.cwd()
    signal.signal(signal.SIGTERM, cli._interrupted)
    spec = json.loads(Path("spec.json").read_text())
    try:
        cli._run(spec, ["-q", "-p", "no:cacheprovider"], ("mutdemo",), 1, dict(__import__("os").environ), {0: {}})
    except KeyboardInterrupt:
        sys.exit(130)
''')


def test_an_interrupted_score_run_stops_the_runner_and_removes_every_scratch_folder(tmp_path):
    env, chosen = _demo(tmp_path)
    job = {"id": 0, "mutant": chosen["add"].__dict__, "tests": ["test_demo.py::test_slow"], "timeout": 120.0}
    (tmp_path / "spec.json").write_text(json.dumps({"jobs": [job], "warm": []}))
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, "driver.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = _wait_for(tmp_path / "started", proc)
    assert sorted(p.name[:7] for p in (tmp_path / "scratch").iterdir()) == ["mutjobs", "mutrun-"]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130 and _gone(child)
    assert list((tmp_path / "scratch").iterdir()) == []


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
        assert module.jump(0) == 3 + 3  # `by=STEP` and the expression `STEP + 0` are bound again
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


BINDINGS = textwrap.dedent('''
    import dataclasses
    import enum

    LOW, HIGH = 4.0, 16.0
    SCALE: float = 2.0
    DOUBLE = SCALE * 2


    class Mode(enum.IntEnum):
        FAST = 0
        SLOW = 1


    @dataclasses.dataclass(frozen=True)
    class Policy:
        k: float = 2.0
        floor: float = dataclasses.field(default=0.5, compare=False)

        def bound(self) -> float:
            return self.k * self.floor


    @dataclasses.dataclass(frozen=True)
    class Strict(Policy):
        name: str = "strict"


    class Adapter:
        channel_dim = 1

        def __init__(self, width=8):
            self.width = width

        def dims(self):
            return self.channel_dim, self.width


    class Child(Adapter):
        def __init__(self, width=8):
            super().__init__(width)


    def window(x, *, lo=LOW, hi=HIGH + 0, scale=DOUBLE):
        return lo * x, hi * x, scale
''')


@pytest.fixture
def bindings(tmp_path, monkeypatch):
    (tmp_path / "mutbind.py").write_text(BINDINGS)
    (tmp_path / "mutbinduser.py").write_text("from mutbind import DOUBLE, LOW\n\n\n"
                                             "def uses(x=LOW * 2):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mutbind", "mutbinduser"):
        sys.modules.pop(name, None)
    module, user = importlib.import_module("mutbind"), importlib.import_module("mutbinduser")
    yield module, user, find_mutants(BINDINGS, module="mutbind", file=module.__file__)
    for name in ("mutbind", "mutbinduser"):
        sys.modules.pop(name, None)


def _site(mutants: list[Mutant], scope: str, new_line: str, qualname: str = "") -> Mutant:
    found = [m for m in mutants if m.scope == scope and m.diff.split("\n")[1] == f"+ {new_line}"
             and qualname in ("", m.qualname)]
    assert len(found) == 1, [(m.scope, m.diff) for m in mutants]
    return found[0]


def test_defaults_and_class_constants_are_mutants_and_enum_members_are_not(bindings):
    _, _, mutants = bindings
    scopes = {(m.scope, m.qualname) for m in mutants}
    assert {("global", "LOW"), ("global", "HIGH"), ("global", "SCALE"), ("default", "Adapter.__init__"),
            ("default", "Child.__init__"), ("class", "Policy.k"), ("class", "Policy.floor"),
            ("class", "Adapter.channel_dim"), ("default", "window")} <= scopes
    assert not any("FAST" in m.diff or "SLOW" in m.diff for m in mutants)  # enum members: not rebindable
    # of field(default=0.5, compare=False) only the default: dataclass read compare once, when it built __eq__
    assert [m.diff.split("\n")[1] for m in mutants if m.qualname == "Policy.floor"] == [
        "+ floor: float = dataclasses.field(default=1.5, compare=False)"]
    assert _site(mutants, "class", "k: float = 3.0").span == (16, 21)  # the class: its methods read it


def test_a_mutated_default_is_rebound_on_the_live_function(bindings):
    module, _, mutants = bindings
    patch_live(_site(mutants, "default", "def __init__(self, width=9):", "Adapter.__init__"), roots=("mutbind",))
    assert module.Adapter().dims() == (1, 9) and module.Child().dims() == (1, 8)  # only Adapter's own default


def test_a_mutated_class_constant_and_field_default_reach_instances_and_subclasses(bindings):
    module, _, mutants = bindings
    patch_live(_site(mutants, "class", "channel_dim = 2"), roots=("mutbind",))
    assert module.Child().dims() == (2, 8)
    patch_live(_site(mutants, "class", "k: float = 3.0"), roots=("mutbind",))
    assert module.Policy().bound() == 1.5 and module.Strict().bound() == 1.5  # the inherited field too
    assert module.Policy(k=4.0).bound() == 2.0
    patch_live(_site(mutants, "class", "floor: float = dataclasses.field(default=1.5, compare=False)"),
               roots=("mutbind",))
    assert module.Policy().bound() == 4.5


def test_a_mutated_constant_reaches_what_import_computed_from_it(bindings):
    module, user, mutants = bindings
    patch_live(_site(mutants, "global", "SCALE: float = 3.0"), roots=("mutbind", "mutbinduser"))
    assert (module.SCALE, module.DOUBLE, user.DOUBLE) == (3.0, 6.0, 6.0)  # a derived constant, where imported too
    assert module.window(1) == (4.0, 16.0, 6.0)
    patch_live(_site(mutants, "global", "LOW, HIGH = 4.0, 17.0"), roots=("mutbind", "mutbinduser"))
    assert module.window(1)[:2] == (4.0, 17.0)  # `HIGH + 0`, an expression default, is bound again
    patch_live(_site(mutants, "global", "LOW, HIGH = 5.0, 16.0"), roots=("mutbind", "mutbinduser"))
    assert user.uses() == 10.0  # an importer's default computed from the imported constant


def test_a_mutant_that_drops_the_last_use_of_a_closure_variable_still_applies(bindings):
    module, _, mutants = bindings
    patch_live(_site(mutants, "function", "pass"), roots=("mutbind",))  # `super().__init__(width)` dropped
    child = module.Child(3)
    assert not hasattr(child, "width")


def test_a_package_init_is_mutated_as_the_package_the_tests_import():
    found = {module: display for _, module, _, display in cli.targets(["replay"], [])}
    assert found["harness.replay.families"] == "harness/replay/families/__init__.py"
    assert not [m for m in found if m.endswith("__init__")]
    ghost = Mutant("harness.replay.families.__init__", "harness/replay/families/__init__.py", 1, 0, "const",
                   "- a\n+ b", "function", "get_family")
    with pytest.raises(PatchError, match="second copy"):
        patch_live(ghost, roots=("harness",))


def test_the_coverage_pass_splits_the_test_files_into_balanced_shards(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["t", "u"]\n')
    for name in ("t/test_a.py", "t/test_b.py", "u/test_c.py", "u/test_d.py", "u/helper.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "coverage-1.json").write_text(json.dumps({"durations": {
        "t/test_a.py::x": 9.0, "t/test_b.py::y": 4.0, "u/test_c.py::z": 3.0, "u/test_d.py::w": 2.0}}))
    assert covmap._shards(tmp_path, ["-m", "cpu"], 2, cache) == [["t/test_a.py"], [
        "t/test_b.py", "u/test_c.py", "u/test_d.py"]]
    assert covmap._shards(tmp_path, ["-m", "cpu", "t/test_b.py"], 2, cache) == [[]]  # the user's selection


def test_a_fresh_machine_splits_the_coverage_pass_by_the_recorded_seconds_per_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["t"]\n')
    (tmp_path / "t").mkdir()
    for name, size in (("test_world.py", 10), ("test_a.py", 40), ("test_b.py", 40), ("test_new.py", 20)):
        (tmp_path / "t" / name).write_text("#" * (size - 1) + "\n")
    recorded = tmp_path / "seconds.json"
    recorded.write_text(json.dumps({"t/test_world.py": 9.0, "t/test_a.py": 4.0, "t/test_b.py": 4.0}))
    empty = tmp_path / "cache"
    empty.mkdir()
    # by size the small world file would share a shard with a big one; its seconds put it alone. The new file is
    # estimated at the record's seconds per byte (17 s / 90 bytes * 20 bytes, about 3.8 s)
    assert covmap._shards(tmp_path, ["-m", "cpu"], 2, empty, recorded) == [
        ["t/test_world.py"], ["t/test_a.py", "t/test_b.py", "t/test_new.py"]]
    assert covmap._shards(tmp_path, ["-m", "cpu"], 2, empty, None) == [
        ["t/test_a.py", "t/test_new.py"], ["t/test_b.py", "t/test_world.py"]]


def test_shard_maps_merge_into_one():
    one = {"lines": {"m.py": {"3": ["a::x"]}}, "caches": {"m.py": {"3": ["cache:k"]}},
           "cache_users": {"cache:k": ["a::x"]}, "durations": {"a::x": 1.0}, "failing": [], "exit": 0}
    two = {"lines": {"m.py": {"3": ["b::y"], "4": ["b::y"]}}, "caches": {"m.py": {"3": ["cache:k"]}},
           "cache_users": {"cache:k": ["b::y"]}, "durations": {"b::y": 2.0}, "failing": ["b::z"], "exit": 1}
    merged = CoverageMap.from_json(covmap._merge([one, two]))
    assert merged.tests_for("m.py", 3) == ["a::x", "b::y"] and merged.tests_for("m.py", 4) == ["b::y"]
    assert merged.cache_users == {"cache:k": ["a::x", "b::y"]} and merged.failing == ["b::z"]
    assert merged.stale_caches("m.py", 3) == ["cache:k"]


def test_the_runner_collapses_only_its_own_private_memory_into_aligned_huge_pages(tmp_path):
    from tools.mutation_score.hugepages import HUGE_PAGE, collapse_private_memory, private_ranges

    maps = "\n".join([
        "00400000-00a00000 r-xp 00000000 08:01 1 /usr/bin/python3.11",    # code: shared with the file
        "01000000-01500000 rw-p 00000000 00:00 0 [heap]",                  # heap: 16 MiB .. 21 MiB
        "7f0000100000-7f0000700000 rw-p 00000000 00:00 0 ",                # anonymous, unaligned at both ends
        "7f0000800000-7f0000900000 rw-p 00000000 00:00 0 ",                # under one huge page once aligned
        "7f0001000000-7f0001400000 rw-p 00000000 08:01 2 /tmp/data.bin",   # a private file mapping
        "7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0 [stack]",
    ])
    assert private_ranges(maps) == [(0x1000000, 0x1400000), (0x7F0000200000, 0x7F0000600000)]
    assert all(first % HUGE_PAGE == 0 and last % HUGE_PAGE == 0 for first, last in private_ranges(maps))
    (tmp_path / "maps").write_text("7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n")  # nothing mapped there
    assert collapse_private_memory(tmp_path / "maps") == 0



def test_a_cache_the_coverage_pass_credits_is_still_a_cache_an_ablation_of_stock_code_swaps(monkeypatch):
    """The coverage pass wraps each functools cache to credit its computation; an ablation of code the stock path
    runs must still find it among the caches it swaps for empty ones, over the function itself (not the old cache):
    else the stock result computed before the ablation is read under it, and the ablation is never seen."""
    from harness.judging import ablation

    calls = []

    @functools.cache
    def stock(x):
        calls.append(x)
        return x * 2

    tracked = covplugin._tracked(stock, covplugin.cache_label(stock))
    module = types.ModuleType("parity.demo_cache")
    module.stock = tracked
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert module.stock(1) == 2 and calls == [1]
    with ablation.fresh_caches() as swapped:
        assert swapped >= 1 and module.stock is not tracked
        assert module.stock(1) == 2 and calls == [1, 1]  # computed again under the ablation
    assert module.stock is tracked and module.stock(1) == 2 and calls == [1, 1]
