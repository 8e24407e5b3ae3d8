"""``pytest --parity-list [PATTERN]``: one hop from a check id to the function that computes it."""

import functools
import importlib

import pytest

from harness.judging import ablation, catalogue, checks
from harness.reports.listing import parity_list

pytestmark = pytest.mark.cpu


def _resolve(where):
    module, _, qualname = where.partition(":")
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def test_every_check_id_maps_to_an_importable_function_and_its_killers():
    catalogue.load()
    lines = {line.split("  ", 1)[0]: line for line in parity_list()}
    assert set(lines) == {c.id for c in checks.all_checks()}, "one line per registered check, no other"
    for check in checks.all_checks():
        line = lines[check.id]
        assert f"  {check.where}  tier={check.tier}" in line
        fn = check.fn.func if isinstance(check.fn, functools.partial) else check.fn
        assert _resolve(check.where) is fn, f"{check.id}: {check.where} does not name the function that computes it"
        for item in ablation.all_ablations():
            if check.id in item.kills:
                assert f"{item.name} ({item.mode_for(check.id)})" in line


def test_every_registered_check_declares_its_policy_and_the_list_prints_it():
    catalogue.load()
    lines = {line.split("  ", 1)[0]: line for line in parity_list()}
    missing = sorted(c.id for c in checks.all_checks() if not c.policy)
    assert not missing, f"checks registered without a policy: {missing[:10]}"
    assert all(f"policy={c.policy}" in lines[c.id] for c in checks.all_checks())


def test_the_option_lists_matching_checks_and_runs_nothing(pytester):
    catalogue.load()
    pytester.makepyfile(test_never="def test_never():\n    raise AssertionError('--parity-list ran a test')\n")
    result = pytester.runpytest("-p", "harness.plugin", "--parity-list", "decode.*")
    assert result.ret == 0
    printed = [line for line in result.stdout.lines if line.strip()]
    expected = sorted(c.id for c in checks.all_checks() if c.id.startswith("decode."))
    assert [line.split("  ", 1)[0] for line in printed] == expected
    assert all(" killers=" in line and " tier=" in line for line in printed)
    assert "passed" not in result.stdout.str() and "failed" not in result.stdout.str()


def test_a_pattern_that_matches_nothing_says_so(pytester):
    result = pytester.runpytest("-p", "harness.plugin", "--parity-list", "video.*")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["no check id matches 'video.*'"])
