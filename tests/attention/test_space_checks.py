"""The attention input space: every drawn point is a check that names its point and builds its input there, and each
input-space bug hides on every input outside its class (the same point with only that axis changed passes)."""

import itertools
import re

import pytest
import torch

from fixtures import attention_space
from fixtures.attention_captures import InputCase, inputs_of
from harness.attention.layout import AttentionLayout
from harness.judging import ablation, catalogue, checks, space
from harness.judging.checks import CheckContext

catalogue.load()

from parity import attention_space_checks  # noqa: E402 - registered by the catalogue load above

pytestmark = pytest.mark.cpu

# the point every input-space bug shows at: custom scale, two rows, GQA group 4 (and KV off the block, fp32)
EVERY_CLASS = {"dtype": "float32", "scale": "custom", "batch": "b2", "group": "g4", "block": "unaligned"}
# ablation -> (the axis of its class, the class's value, the values outside the class)
CLASSES = {
    "attention.scale_dropped": ("scale", "custom", ("default",)),
    "attention.batch_head_flattened_apart": ("batch", "b2", ("b1",)),
    "attention.gqa_group_hard_coded": ("group", "g4", ("g1", "g2")),
}


def test_the_attention_axes_are_closed_id_words_no_two_axes_share_a_value():
    values = [v for a in space.AXES["attention"].values() for v in a.values]
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", v) for v in values), values
    assert len(values) == len(set(values)), "a label must read back to one point"
    assert set(attention_space.SPACE) == {"dtype", "scale", "batch", "group", "block"}


def test_every_drawn_point_is_a_check_named_by_its_point_and_every_pair_is_drawn():
    points = attention_space.POINTS
    for point in points:
        check_id = f"attention.space.{'-'.join(point.values())}"
        assert str(attention_space.check_id(point)) == check_id
        assert checks.exists(check_id) and space.point(check_id) == point
    pairs = {(a, p[a], b, p[b]) for p in points for a, b in itertools.combinations(attention_space.SPACE, 2)}
    every = {(a, x, b, y) for a, b in itertools.combinations(attention_space.SPACE, 2)
             for x in attention_space.SPACE[a] for y in attention_space.SPACE[b]}
    assert pairs == every
    registered = {c.id for c in checks.all_checks("cpu") if c.id.startswith("attention.space.")}
    assert registered == {str(attention_space.check_id(p)) for p in points}


def test_ids_where_selects_the_drawn_points_of_a_class():
    custom = attention_space.ids_where(scale="custom")
    assert custom and all("-custom-" in i for i in custom)
    assert len(attention_space.ids_where()) == len(attention_space.POINTS)
    assert set(attention_space.ids_where(scale="custom", batch="b2")) == {
        i for i in custom if "-b2-" in i}


@pytest.mark.parametrize(("block", "batch", "group", "scale", "dtype"), [
    ("aligned", "b1", "g1", "default", "float32"), ("unaligned", "b2", "g4", "custom", "bfloat16"),
    ("aligned", "b2", "g2", "custom", "float32")])
def test_a_point_builds_its_input(block, batch, group, scale, dtype):
    point = {"dtype": dtype, "scale": scale, "batch": batch, "group": group, "block": block}
    case = attention_space.case_at(point)
    inputs = inputs_of(case, "cpu")
    capture, layout = inputs.capture, case.layout
    rows, groups = int(batch[1:]), int(group[1:])
    assert (capture.query.shape[0], capture.heads, capture.kv_heads) == (rows, 2 * groups, 2)
    assert capture.query.dtype == getattr(torch, dtype) and (capture.kv_len, capture.q_len) == (layout.kv_len,) * 2
    assert (layout.kv_len % 128 == 0) == (block == "aligned") and (layout.kv_len % 64 == 0) == (block == "aligned")
    assert layout.images and layout.phase == "prefill"
    default = attention_space.HEAD_DIM ** -0.5
    assert case.pass_scale == (scale == "custom")
    assert capture.scale == (attention_space.CUSTOM_SCALE if scale == "custom" else default)
    assert default != attention_space.CUSTOM_SCALE
    if rows > 1:
        assert not torch.equal(capture.query[0], capture.query[1]) and not torch.equal(capture.key[0], capture.key[1])


def test_a_point_names_every_axis():
    with pytest.raises(ValueError, match=r"lacks \['block'\]"):
        attention_space.case_at({"dtype": "float32", "scale": "custom", "batch": "b2", "group": "g4"})


def test_an_input_case_passes_any_scale_but_the_default():
    layout = AttentionLayout(4, 4, 1, "prefill")
    with pytest.raises(ValueError, match="must be passed"):
        InputCase("x", layout, scale=0.5, pass_scale=False)
    assert "B 2, " in InputCase("x", layout, batch=2, scale=0.5).describe()
    assert "scale 0.5 given" in InputCase("x", layout, scale=0.5).describe()
    assert "scale=None" in InputCase("x", layout, pass_scale=False).describe()
    assert "B " not in InputCase("x", layout).describe()


@pytest.mark.parametrize("name", list(CLASSES))
def test_each_input_space_bug_is_seen_in_its_class_only(name):
    """Under the ablation the point with every class fails on its numbers; the same point with only this class's
    axis moved out of it passes: without the class the bug hides. The ablation claims exactly its class's checks."""
    axis, inside, outside = CLASSES[name]
    item = ablation.get(name)
    assert sorted(item.kills) == sorted(attention_space.ids_where(**{axis: inside}))
    ctx = CheckContext()
    for value in outside:  # fill the caches unablated and make sure the twins pass there first
        assert attention_space_checks.judge_point({**EVERY_CLASS, axis: value}, ctx).passed
    assert attention_space_checks.judge_point(EVERY_CLASS, ctx).passed
    with item.apply():
        caught = attention_space_checks.judge_point(EVERY_CLASS, ctx)
        hidden = {value: attention_space_checks.judge_point({**EVERY_CLASS, axis: value}, ctx) for value in outside}
    assert not caught.passed and caught.margin > 1, caught.describe()
    for value, verdict in hidden.items():
        assert verdict.passed, f"{name} at {axis}={value}:\n{verdict.describe()}"
