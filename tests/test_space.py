"""The points a generated space check runs at: every pair of values of any two axes at least once, the points a
constraint forbids never, a per-commit seeded draw on top, every point with PARITY_SPACE=full; ids that name them."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
from pathlib import Path

import pytest
from allpairspy import AllPairs

from harness.judging import space

pytestmark = pytest.mark.cpu

AXES = {"dtype": ("bf16", "fp16", "fp32"), "config": ("on", "none", "off"), "velocity": ("identity", "negate"),
        "layout": ("uncond_first", "fused"), "steps": ("s2", "s5")}


def _pairs(points: list[dict[str, str]]) -> set[tuple[str, str, str, str]]:
    return {(a, p[a], b, p[b]) for p in points for a, b in itertools.combinations(AXES, 2)}


def test_every_pair_of_values_is_covered_by_fewer_points_than_the_whole_space():
    points = space.covering(AXES, seed=1)
    every = {(a, x, b, y) for a, b in itertools.combinations(AXES, 2) for x in AXES[a] for y in AXES[b]}
    assert _pairs(points) == every
    assert len(points) < len(list(itertools.product(*AXES.values()))) / 4


def test_without_a_constraint_the_core_is_allpairspys_covering_array():
    rows = AllPairs([list(values) for values in AXES.values()])
    assert space.covering(AXES, seed=1) == [dict(zip(AXES, row, strict=True)) for row in rows]


def test_the_seeded_draw_adds_other_points_the_same_for_one_seed():
    core = space.covering(AXES, seed=1)
    drawn = space.covering(AXES, seed=1, extra=3)
    assert drawn[:len(core)] == core and len(drawn) == len(core) + 3
    assert space.covering(AXES, seed=1, extra=3) == drawn
    assert {space.label(p) for p in drawn[len(core):]}.isdisjoint({space.label(p) for p in core})
    assert space.covering(AXES, seed=2, extra=3)[len(core):] != drawn[len(core):]


def test_a_constraint_keeps_its_points_out_and_the_pairs_it_allows_in():
    def allowed(point):
        return not (point["config"] == "none" and point["velocity"] == "negate")

    points = space.covering(AXES, seed=1, extra=5, allowed=allowed)
    assert all(allowed(p) for p in points)
    assert ("config", "none", "velocity", "identity") in _pairs(points)


def test_every_pair_a_constraint_allows_is_covered_even_where_allpairs_leaves_one_out():
    axes = {"grid": ("even", "odd"), "ranks": ("r2", "r3", "r4"), "count": ("few", "many"), "groups": ("one", "two"),
            "dtype": ("fp32", "bf16")}

    def allowed(point):
        return point["groups"] == "one" or point["ranks"] == "r4"

    points = space.covering(axes, seed=1, allowed=allowed)
    every = [dict(zip(axes, row, strict=True)) for row in itertools.product(*axes.values())]
    wanted = {(a, p[a], b, p[b]) for p in every if allowed(p) for a, b in itertools.combinations(axes, 2)}
    covered = {(a, p[a], b, p[b]) for p in points for a, b in itertools.combinations(axes, 2)}
    assert all(allowed(p) for p in points) and wanted <= covered  # ("ranks", "r4", "groups", "one") among them
    assert len({space.label(p) for p in points}) == len(points)


def test_the_full_space_on_demand(monkeypatch):
    monkeypatch.setenv(space.FULL_SPACE_ENV, "full")
    assert len(space.covering(AXES, seed=1, extra=3)) == 3 * 3 * 2 * 2 * 2


def test_a_label_is_one_id_segment_in_axis_order():
    assert space.label({"dtype": "bf16", "config": "none", "velocity": "negate"}) == "bf16-none-negate"


def test_the_commit_seed_follows_the_checked_out_commit(tmp_path):
    assert space.commit_seed(tmp_path) == 0  # not a git checkout
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=tmp_path, check=True)
    seed = space.commit_seed(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert seed == int(hashlib.sha256(head.stdout.strip().encode()).hexdigest()[:16], 16)  # its first 64 bits


def test_the_commit_seed_without_a_root_is_the_suites_own_checkouts():
    repo = Path(space.__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip("the suite runs from outside a git checkout")
    assert space.commit_seed() == space.commit_seed(repo) != 0


def test_a_misspelt_space_mode_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(space.FULL_SPACE_ENV, "Full")
    with pytest.raises(ValueError, match="PARITY_SPACE='Full': expected one of pairwise, full"):
        space.covering({"a": ("x", "y")}, seed=0)
    monkeypatch.setenv(space.FULL_SPACE_ENV, "")
    assert space.space_mode() == "pairwise"


def test_each_path_names_the_axis_its_implementations_are_given_per():
    """``--impl PATH.SUBJECT`` reads the subject off this axis: replay's family, ar's model, decode's VAE; attention
    has none (one kernel judges every check)."""
    from harness.judging import space as space_mod

    subjects = {path: getattr(space_mod.subject_axis(path), "name", None) for path in space_mod.AXES}
    assert subjects == {"replay": "family", "ar": "model", "decode": "vae", "attention": None}
    assert all(sum(a.subject for a in axes.values()) <= 1 for axes in space_mod.AXES.values())


def test_an_axis_says_what_a_check_drives_only_when_told():
    assert not space.Axis("layout", "how the rows are laid out").subject
    assert space.Axis("family", "the family a check drives", subject=True).subject
