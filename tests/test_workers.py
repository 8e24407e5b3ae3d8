"""A run split over pytest-xdist workers reports what the same run does serially, byte for byte."""

import json
import pickle
from types import SimpleNamespace

import pytest

from harness import given_inputs, workers
from harness.inputs.ledger import NOT_REACHED, RAN, SKIPPED, InputLedger, ItemEnd
from harness.judging.ablation import KillResult
from harness.judging.compare import Verdict
from harness.plugins.conformance_run import IMPLS_KEY, never_ran
from harness.reports.bench import BenchLog
from harness.reports.report import Unfinished
from harness.session import SESSION_KEY
from tests.test_plugin import GENERATED_TESTS as PLUGIN_TESTS
from tests.test_plugin import _clean_registry  # noqa: F401 - the demo registries, cleaned around each test

pytest.importorskip("xdist")

DEMO_IMPL = '''
def scale(x):
    return [2 * v for v in x]


def stock(x):
    return [v + v for v in x]
'''

# every baseline judgement of a check leaves a line in judged.log: which check, in which process
DEMO_CHECKS = '''
import os
import time
import torch
import demo_impl
from harness.judging import ablation
from harness.judging.checks import register
from harness.judging.compare import exact, close


def _judged(name):
    if ablation.active():  # a kill run, not the check's baseline
        return
    with open(os.path.join(os.environ["DEMO_LOG_DIR"], "judged.log"), "a") as log:
        log.write(f"{name} {os.getpid()}\\n")


def _exact(name, n):
    def check(ctx):
        _judged(name)
        if name.startswith("demo."):
            time.sleep(0.2)  # the demo path keeps its worker busy while the other takes the rest
        x = [float(i) for i in range(1, n + 1)]
        return exact().judge(torch.tensor(demo_impl.scale(x)), torch.tensor(demo_impl.stock(x)))
    return check


for i in range(6):
    register(f"demo.w{i}.exact")(_exact(f"demo.w{i}.exact", i + 2))


@register("demo.loose.close")
def loose(ctx):
    _judged("demo.loose.close")
    x = [1.0, 2.0]
    return close(atol=10.0, rtol=0.0, reason="demo").judge(torch.tensor(demo_impl.scale(x)),
                                                          torch.tensor(demo_impl.stock(x)))


@register("demo.wrong.exact")
def wrong(ctx):
    _judged("demo.wrong.exact")
    return exact().judge(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))


@register("demo.skips.exact")
def skips(ctx):
    import pytest
    pytest.skip("this demo has nothing to judge")


register("twin.w0.exact")(_exact("twin.w0.exact", 3))  # a second path: a unit of work of its own
'''

DEMO_ABLATIONS = '''
from harness.judging.ablation import ablation

ablation("demo.plus_one", "demo_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=[f"demo.w{i}.exact" for i in (5, 3, 1, 0)] + ["demo.loose.close"],
         why="adds one to every element", kill_mode="tolerance")
ablation("demo.times_three", "demo_impl:scale", lambda x: [3 * v for v in x],
         kills=["demo.w4.exact", "demo.w2.exact"], why="triples", kill_mode="tolerance")
'''

GENERATED_TESTS = PLUGIN_TESTS + '''

@pytest.mark.cpu
def test_outside_the_checks_fails():
    assert False, "a test that is no parity check"
'''


@pytest.fixture
def demo(pytester, monkeypatch):
    pytester.makepyfile(demo_impl=DEMO_IMPL, demo_checks=DEMO_CHECKS, demo_ablations=DEMO_ABLATIONS,
                        test_demo=GENERATED_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=":")
    return pytester


def _run(demo, monkeypatch, name, *args):
    (demo.path / name).mkdir()
    monkeypatch.setenv("DEMO_LOG_DIR", str(demo.path / name))
    result = demo.runpytest_subprocess("-p", "harness.plugin", "-m", "cpu", f"--parity-report={name}/parity.json",
                                       f"--parity-report={name}/parity.md", *args)
    return result, demo.path / name


@pytest.mark.launch  # two whole pytest runs, one with two workers (seconds): with the launchers, out of the gate
def test_a_split_run_writes_the_serial_report_and_judges_each_check_once(demo, monkeypatch):
    serial, serial_dir = _run(demo, monkeypatch, "serial")
    split, split_dir = _run(demo, monkeypatch, "split", "-n", "2")
    assert serial.ret == split.ret == pytest.ExitCode.TESTS_FAILED
    assert (split_dir / "parity.json").read_bytes() == (serial_dir / "parity.json").read_bytes()
    assert (split_dir / "parity.md").read_bytes() == (serial_dir / "parity.md").read_bytes()
    data = json.loads((split_dir / "parity.json").read_text())
    # the order is the catalogue's, not the workers': checks as registered, pairs as each ablation claims them
    assert [c["id"] for c in data["checks"]][:3] == ["demo.w0.exact", "demo.w1.exact", "demo.w2.exact"]
    assert [k["check"] for k in data["ablations"][0]["kills"]] == [
        "demo.w5.exact", "demo.w3.exact", "demo.w1.exact", "demo.w0.exact", "demo.loose.close"]
    assert {c["id"]: c["status"] for c in data["checks"]}["demo.skips.exact"] == "skipped"
    # both workers judged checks (each path a unit of work), and a kill item found its check's baseline on its own
    # worker: one judgement each
    judged = (split_dir / "judged.log").read_text().split("\n")
    lines = [line.split() for line in judged if line]
    assert len({pid for _, pid in lines}) == 2, lines
    assert len({pid for name, pid in lines if name.startswith("demo.")}) == 1, lines
    names = [name for name, _ in lines]
    assert sorted(names) == sorted(set(names)), names
    split.stdout.fnmatch_lines(["*fastpath-parity report*", "FAIL*demo.wrong.exact*"])


def _state(config, **fields):
    base = dict(verdicts={}, kills=[], unfinished={}, pairs_unfinished={}, other_failures=[], calls={},
                benchmarks=SimpleNamespace(tables={}), stashed=[None, None, None], ledger_items={}, catalogue=[])
    base.update(fields)
    state = workers.WorkerState.__new__(workers.WorkerState)
    state.__dict__.update(base)
    return SimpleNamespace(config=config, workeroutput={workers.OUTPUT_KEY: pickle.dumps(state)})


@pytest.mark.cpu
def test_the_controller_merges_how_far_each_worker_got_and_what_it_counted(pytester):
    config = pytester.parseconfigure("-p", "harness.plugin")
    label = "--capture-dir=/captures"
    ledger = config.stash[given_inputs.INPUTS_KEY] = InputLedger((label,))
    verdict = Verdict("demo.a.exact", True, {}, "exact", 0.0)
    kill = KillResult("demo.k", "demo.a.exact", True, None, "tolerance")
    tables = []
    for steps in (2, 4):  # one bench table, a row measured on each worker
        log = BenchLog()
        log.record("replay", "replay", {"steps": steps}, fast=1.0, stock=2.0)
        tables.append(log)
    first = _state(config, verdicts={"demo.a.exact": verdict}, kills=[kill], calls={"demo": 2}, benchmarks=tables[0],
                   unfinished={"demo.b.exact": Unfinished("demo.b.exact", "skipped", "why")},
                   ledger_items={"t::a": ItemEnd((label,), RAN, ""), "t::b": ItemEnd((label,), NOT_REACHED)})
    second = _state(config, calls={"demo": 3}, other_failures=["t::c (call: AssertionError)"], benchmarks=tables[1],
                    ledger_items={"t::a": ItemEnd((label,), NOT_REACHED), "t::b": ItemEnd((label,), SKIPPED, "no")})
    workers.merge(config, first)
    workers.merge(config, second)
    parity = config.stash[SESSION_KEY]
    assert parity.verdicts == {"demo.a.exact": verdict} and parity.kills == [kill]
    assert set(parity.unfinished) == {"demo.b.exact"}
    assert parity.other_failures == ["t::c (call: AssertionError)"]
    assert {n: e.how for n, e in ledger.items.items()} == {"t::a": RAN, "t::b": SKIPPED}  # the furthest each got
    assert ledger.idle() == {}
    assert workers.merged_calls(config) == {"demo": 5}
    assert [r.case for r in parity.benchmarks.tables["replay"].rows.values()] == [{"steps": 2}, {"steps": 4}]
    workers.merge(config, SimpleNamespace(config=config, workeroutput={}, gateway=SimpleNamespace(id="gw1")))
    assert workers.merged_calls(config) == {"demo": 5}  # a worker that died shipped nothing, and is named
    assert parity.other_failures[-1].startswith("gw1 went down without handing over its records")
    config._ensure_unconfigure()


@pytest.mark.cpu
def test_an_implementation_called_only_in_workers_ran():
    config = SimpleNamespace(stash={IMPLS_KEY: {"decode": "mod:fn"}})
    assert never_ran(config, {"decode"}) == ["--impl decode=mod:fn: no decode check called the implementation "
                                             "under test"]
    assert never_ran(config, {"decode"}, {"decode": 1}) == []
    assert never_ran(config, {"decode"}, {"ar": 1}) != []


@pytest.mark.cpu
@pytest.mark.parametrize(("nodeid", "scope"), [
    ("parity/test_parity.py::test_parity_check[decode.t37.w4.bitexact]", "decode"),
    ("parity/test_parity.py::test_parity_check[attention.prefill.flex.vs_sdpa]", "attention"),
    ("mutation/test_kill_matrix.py::test_ablation_kills_check[decode.rank0_clips_only->decode.t12.w2.bitexact]",
     "decode"),
    ("gpu/test_gpu.py::test_kill[decode.x->decode.gpu.bitexact[vae-fp32]]", "decode"),
    ("tests/ar/test_properties.py::test_case[fake]", "tests/ar/test_properties.py::test_case[fake]"),
    ("tests/test_dist.py::test_pool", "tests/test_dist.py::test_pool"),
])
def test_a_paths_checks_and_their_kill_items_are_one_unit_of_work_and_any_other_test_its_own(nodeid, scope):
    assert workers.check_scope(nodeid) == scope


@pytest.mark.cpu
def test_a_split_gpu_run_is_a_usage_error_naming_both_options(pytester):
    result = pytester.runpytest("-p", "harness.plugin", "-n", "2", f"--checkpoint={pytester.path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--checkpoint with -n: the gpu tier places its models and ranks per process*"])
