"""Capture I/O in the seed's npz format and the synthetic generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from fixtures.attention_captures import small_capture
from fixtures.attention_strategies import layouts
from harness.attention import capture as capture_io
from harness.attention import contract, judge, policies
from harness.attention.layout import SEED_SCALE, AttentionLayout

pytestmark = pytest.mark.cpu

PREFILL = AttentionLayout(7, 12, 3, "prefill")
DENOISE = AttentionLayout(7, 12, 3, "denoise")


@settings(max_examples=15, deadline=None)
@given(layouts(min_image=2))
def test_npz_round_trip_is_bit_exact(tmp_path_factory, layout: AttentionLayout):
    capture = small_capture(layout, heads=2, head_dim=8, seed=layout.kv_len)
    path = capture_io.save_capture(capture, tmp_path_factory.mktemp("cap") / capture_io.capture_name(0))
    loaded = capture_io.load_capture(path, scale=capture.scale)
    for name in capture_io.CAPTURE_ARRAYS:
        assert getattr(loaded, name).equal(getattr(capture, name)), name
    assert capture_io.peek_shapes(path) == {name: tuple(getattr(capture, name).shape)
                                            for name in capture_io.CAPTURE_ARRAYS}
    assert contract.verify_mask(loaded.mask).mismatches == 0


def test_seed_format_arrays_and_names(tmp_path):
    capture = small_capture(PREFILL)
    path = capture_io.save_capture(capture, tmp_path / "call0_rank0.npz")
    with np.load(path) as z:
        assert sorted(z.files) == sorted(capture_io.CAPTURE_ARRAYS)
        assert z["query"].dtype == np.float32 and z["mask"].dtype == np.bool_
        assert z["query"].shape == (1, PREFILL.q_len, 2, 16)  # (B, S, H, D)
        assert z["mask"].shape == (1, 1, PREFILL.q_len, PREFILL.kv_len)


def test_a_capture_taken_from_a_forward_that_tracks_gradients_saves_its_values(tmp_path):
    capture = small_capture(PREFILL)
    tracked = dataclasses.replace(capture, query=capture.query.clone().requires_grad_(True))
    path = capture_io.save_capture(tracked, tmp_path / "call0_rank0.npz")
    with np.load(path) as z:
        assert np.array_equal(z["query"], capture.query.float().numpy())


def test_synthetic_capture_is_deterministic_and_bf16_valued():
    a, b = small_capture(DENOISE, seed=5), small_capture(DENOISE, seed=5)
    c = small_capture(DENOISE, seed=6)
    assert all(getattr(a, n).equal(getattr(b, n)) for n in capture_io.CAPTURE_ARRAYS)
    assert not a.query.equal(c.query)
    assert a.query.equal(a.query.to(torch.bfloat16).float())
    assert a.mask.shape == (1, 1, DENOISE.q_len, DENOISE.kv_len)
    assert contract.detect_layout(a.mask) == DENOISE


def test_seed_defaults_are_the_seed_head_shape():
    """SEED_HEADS and SEED_HEAD_DIM are the seed model's: its captures are rank 0 of a TP=4 run, 32 heads sharded 4
    ways, of head dim 128."""
    capture = capture_io.synthetic_capture(AttentionLayout(3, 4, 1, "prefill"), seed=0)
    assert (capture.heads, capture.kv_heads, capture.query.shape[-1]) == (8, 8, 128)
    assert capture.scale == SEED_SCALE == 128 ** -0.5


def test_a_dump_at_the_seed_head_dim_loads_at_its_own_softmax_scale(tmp_path):
    """A dump of the seed model (8 heads of dim 128) loaded without a scale is at 1 / sqrt(128), the scale the model
    ran it at, so a kernel called with scale=None judges it."""
    dump = capture_io.synthetic_capture(AttentionLayout(3, 4, 1, "prefill"), heads=8, head_dim=128, seed=0)
    loaded = capture_io.load_capture(capture_io.save_capture(dump, tmp_path / "call0_rank0.npz"))
    assert loaded.scale == 128 ** -0.5
    control = policies.floor_control(loaded)
    verdict = judge.compare_kernel("sdpa", loaded, policies.floor_policy(control), floor=control, pass_scale=False)
    assert verdict.passed and verdict.metrics["scale"] == "None", verdict.describe()


def test_find_captures_orders_by_call_then_rank_and_phases_are_told_apart(tmp_path):
    for name, layout in (("call10_rank0.npz", DENOISE), ("call2_rank1.npz", PREFILL), ("call2_rank0.npz", PREFILL)):
        capture_io.save_capture(small_capture(layout, heads=1, head_dim=8), tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a capture")
    assert [p.name for p in capture_io.find_captures(tmp_path)] == [
        "call2_rank0.npz", "call2_rank1.npz", "call10_rank0.npz"]
    assert capture_io.phase_capture_path(tmp_path, "prefill").name == "call2_rank0.npz"
    assert capture_io.phase_capture_path(tmp_path, "denoise").name == "call10_rank0.npz"


def test_seed_file_names_win(tmp_path):
    """call0 is the prefill pass and call32 a denoise pass, even with another denoise call (call1) before it."""
    for call, layout in ((0, PREFILL), (1, DENOISE), (32, DENOISE)):
        capture_io.save_capture(small_capture(layout, heads=1, head_dim=8), tmp_path / capture_io.capture_name(call))
    picked = {phase: capture_io.phase_capture_path(tmp_path, phase).name for phase in ("prefill", "denoise")}
    assert picked == {"prefill": "call0_rank0.npz", "denoise": "call32_rank0.npz"}


def test_select_heads_keeps_gqa_groups():
    capture = small_capture(PREFILL, heads=4, kv_heads=2)
    two = capture.select_heads(2)
    assert (two.heads, two.kv_heads) == (2, 1)
    assert two.query.equal(capture.query[:, :, :2]) and two.key.equal(capture.key[:, :, :1])
    with pytest.raises(ValueError, match="multiple of the GQA group 2"):
        capture.select_heads(1)


def test_kernel_checks_are_gated_on_the_capture_being_read_right():
    """A capture whose mask the detected layout does not rebuild fails every kernel check (instead of judging a
    kernel against a misread layout); a capture with several images is read right and judged."""
    from fixtures.attention_captures import _inputs
    from parity.attention_checks import _compare

    several = AttentionLayout(30, 40, 2, "prefill", images=((3, 9), (12, 20)))
    read = _inputs(small_capture(several, heads=2, kv_heads=1, seed=5))
    assert read.misread is None and read.layout == several
    assert _compare("decomposed", read).passed
    capture = small_capture(several, heads=2, kv_heads=1, seed=5)
    mask = capture.mask.clone()
    mask[0, 0, 5, 25] = True  # a pair no structured layout admits
    misread = _inputs(dataclasses.replace(capture, mask=mask))
    assert misread.misread is not None
    verdict = _compare("decomposed", misread)
    assert not verdict.passed and verdict.violated_facts == [
        "synthetic_call0_rank0.npz: its mask is its layout's (see attention.capture.*.contract)"]
