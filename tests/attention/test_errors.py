"""Bad input gets a clear error naming what was wrong and what was expected."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fixtures.attention_captures import small_capture
from harness.attention import capture as capture_io
from harness.attention import contract, judge, kernels, padded, reference
from harness.attention.layout import AttentionLayout

pytestmark = pytest.mark.cpu

LAYOUT = AttentionLayout(4, 6, 2, "prefill")


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"text_len": -1, "image_len": 4, "special_len": 0}, ValueError, "text_len must be >= 0"),
    ({"text_len": 2, "image_len": 0, "special_len": 0}, ValueError, "image span cannot be empty"),
    ({"text_len": 2.0, "image_len": 4, "special_len": 0}, TypeError, "text_len must be an int"),
    ({"text_len": True, "image_len": 4, "special_len": 0}, TypeError, "text_len must be an int"),
    ({"text_len": 2, "image_len": 4, "special_len": 0, "phase": "decode"}, ValueError, "phase must be one of"),
    ({"text_len": 2, "image_len": 4, "special_len": 3, "phase": "denoise"}, ValueError,
     "special_len must be <= text_len"),
    ({"text_len": 20, "image_len": 4, "special_len": 0, "images": ((4, 10), (8, 12))}, ValueError,
     r"earlier image span \(8, 12\) must hold >= 2 tokens, follow the previous one \(from 10\)"),
    ({"text_len": 20, "image_len": 4, "special_len": 0, "images": ((4, 5),)}, ValueError, "must hold >= 2 tokens"),
    ({"text_len": 20, "image_len": 4, "special_len": 2, "phase": "denoise", "images": ((10, 19),)}, ValueError,
     "and end by 18"),
    ({"text_len": 20, "image_len": 4, "special_len": 0, "images": [(4, 10)]}, TypeError, "must be a tuple"),
    ({"text_len": 20, "image_len": 4, "special_len": 0, "images": ((4, 10.0),)}, TypeError, "int pairs"),
])
def test_bad_layouts(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        AttentionLayout(**kwargs)


def _qkv(q_len=LAYOUT.q_len, kv_len=LAYOUT.kv_len, heads=2, kv_heads=2, dim=8, dtype=torch.float32):
    return (torch.zeros(1, heads, q_len, dim, dtype=dtype), torch.zeros(1, kv_heads, kv_len, dim, dtype=dtype),
            torch.zeros(1, kv_heads, kv_len, dim, dtype=dtype))


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
@pytest.mark.parametrize(("inputs", "exc", "match"), [
    (_qkv(q_len=LAYOUT.q_len - 1), ValueError, r"inputs hold Q 11 x KV 12 but the layout .* needs Q 12 x KV 12"),
    (_qkv(heads=3, kv_heads=2), ValueError, "3 query heads are not a multiple of 2 key/value heads"),
    (_qkv(dtype=torch.int32), TypeError, "query must be floating point"),
    ((torch.zeros(2, LAYOUT.q_len, 8), *_qkv()[1:]), ValueError, r"query must be \(B, H, S, D\) heads-first"),
    ((_qkv()[0], torch.zeros(1, 2, LAYOUT.kv_len, 4), torch.zeros(1, 2, LAYOUT.kv_len, 4)), ValueError,
     "must share batch and head dim"),
])
def test_kernels_reject_inputs_that_do_not_fit_the_layout(name, inputs, exc, match):
    with pytest.raises(exc, match=match):
        kernels.get_kernel(name)(*inputs, LAYOUT)


def test_kernels_reject_a_non_layout():
    with pytest.raises(TypeError, match="layout must be an AttentionLayout"):
        reference.masked_sdpa(*_qkv(), (4, 6, 2))


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'.*known"):
        kernels.get_kernel("flash")


@pytest.mark.parametrize("block", [0, -128, 1.5, True])
def test_bad_block_sizes(block):
    with pytest.raises(ValueError, match="block size must be a positive int"):
        padded.padded_length(100, block)


def test_pad_mask_refuses_to_shrink():
    with pytest.raises(ValueError, match="cannot pad a 3 x 4 mask down to 2 x 4"):
        padded.pad_mask(torch.ones(3, 4, dtype=torch.bool), 2, 4)


def test_non_gqa_kernel_refuses_a_gqa_capture():
    spec = kernels.KernelSpec("dense_only", reference.masked_sdpa, False, lambda lay: 0, lambda *a: [], "test")
    capture = small_capture(LAYOUT, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="does not claim GQA.*2 query heads over 1 key/value heads"):
        judge.compare_kernel(spec, capture, judge.floor_policy(judge.floor_control(capture)))


@pytest.mark.parametrize(("mask", "exc", "match"), [
    (torch.ones(3, 4), TypeError, "mask must be bool"),
    (torch.ones(2, 3, 4, dtype=torch.bool), ValueError, r"mask must be \(Q, KV\) or \(B, 1, Q, KV\)"),
    (torch.ones(1, 2, 3, 4, dtype=torch.bool), ValueError, "1 head-broadcast entry"),
    (torch.ones(5, 4, dtype=torch.bool).tril(), ValueError, "more query rows .5. than keys .4."),
    (torch.ones(4, 4, dtype=torch.bool).tril(), ValueError, "no image span"),
])
def test_detect_layout_rejects_masks_outside_the_family(mask, exc, match):
    with pytest.raises(exc, match=match):
        contract.detect_layout(mask)


def test_denoise_mask_with_keys_past_the_span_is_named():
    mask = contract.formula_mask(6, 10, (3, 8))  # keys 8, 9 lie past the span end
    with pytest.raises(ValueError, match="keys past the span end 8"):
        contract.detect_layout(mask)


def test_formula_refuses_more_queries_than_keys():
    with pytest.raises(ValueError, match="query rows .5. cannot exceed keys .4."):
        contract.formula_mask(5, 4, (1, 3))


def _write(path, **arrays):
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    return path


def test_load_capture_names_the_file_and_array(tmp_path):
    good = {name: getattr(small_capture(LAYOUT, heads=1, head_dim=4), name).numpy()
            for name in capture_io.CAPTURE_ARRAYS}
    with pytest.raises(ValueError, match="does not exist"):
        capture_io.load_capture(tmp_path / "call0_rank0.npz")
    missing = _write(tmp_path / "a.npz", **{k: v for k, v in good.items() if k != "value"})
    with pytest.raises(ValueError, match=r"a.npz: missing arrays \['value'\]"):
        capture_io.load_capture(missing)
    half = _write(tmp_path / "b.npz", **{**good, "query": good["query"].astype(np.float16)})
    with pytest.raises(TypeError, match="b.npz: query must be float32, got float16"):
        capture_io.load_capture(half)
    float_mask = _write(tmp_path / "c.npz", **{**good, "mask": good["mask"].astype(np.float32)})
    with pytest.raises(TypeError, match="c.npz: mask must be bool"):
        capture_io.load_capture(float_mask)
    wrong = _write(tmp_path / "d.npz", **{**good, "mask": good["mask"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"d.npz: mask must be bool of shape \(B, 1, Q, KV\) = \(1, 1, 12, 12\)"):
        capture_io.load_capture(wrong)


def test_capture_directories_without_captures(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        capture_io.find_captures(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"holds no call<N>_rank<R>\.npz files"):
        capture_io.find_captures(tmp_path)
    capture_io.save_capture(small_capture(LAYOUT, heads=1, head_dim=4), tmp_path / "call3_rank0.npz")
    with pytest.raises(ValueError, match="holds no denoise capture"):
        capture_io.phase_capture_path(tmp_path, "denoise")


def test_synthetic_capture_rejects_bad_heads():
    with pytest.raises(ValueError, match=r"heads \(3\) must be a positive multiple of kv_heads \(2\)"):
        capture_io.synthetic_capture(LAYOUT, heads=3, kv_heads=2, head_dim=4, seed=0)


def test_a_capture_at_another_scale_is_judged_with_its_scale_and_refused_without_it():
    """scale=None is only the capture's own scale when that is the default 1 / sqrt(D)."""
    scaled = dataclasses.replace(small_capture(LAYOUT), scale=0.125)
    for capture, pass_scale in ((scaled, True), (small_capture(LAYOUT), False)):
        control = judge.floor_control(capture)
        verdict = judge.compare_kernel("decomposed", capture, judge.floor_policy(control),
                                        floor=control, pass_scale=pass_scale)
        assert verdict.passed, verdict.describe()
    with pytest.raises(ValueError, match=r"scale=None means 1 / sqrt\(16\), but capture .* at scale 0.125"):
        judge.compare_kernel("decomposed", scaled, judge.floor_policy(control), pass_scale=False)
    control = judge.floor_control(scaled)
    by_default = judge.compare_kernel("decomposed", scaled, judge.floor_policy(control), floor=control)
    assert by_default.passed and by_default.metrics["scale"] == "given", by_default.describe()  # the capture's own


def test_a_kernel_output_in_another_dtype_fails_the_output_fact():
    """The output must be (B, H, Q, D) in the inputs' dtype: a kernel that hands back fp64 does not pass."""
    wide = kernels.KernelSpec("wide", lambda q, k, v, layout, *, scale, block=None: reference.masked_sdpa(
        q.double(), k.double(), v.double(), layout, scale=scale), False, lambda lay: 0, lambda *a: [], "test")
    capture = small_capture(LAYOUT)
    control = judge.floor_control(capture)
    verdict = judge.compare_kernel(wide, capture, judge.floor_policy(control), floor=control)
    assert "the output is (B, H, Q, D) in the inputs' dtype" in verdict.violated_facts, verdict.describe()
