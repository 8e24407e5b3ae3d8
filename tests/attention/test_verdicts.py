"""The attention verdicts: the contract and builder facts name the span and the first mismatch; a
kernel's GQA claim and the relative-L2 bound decide what compare_kernel requires."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fixtures.attention_captures import small_capture
from harness.attention import contract, judge, kernels, masks, reference
from harness.attention.layout import AttentionLayout
from harness.attention.policies import (
    FloorControl,
    floor_control,
    floor_policy,
    in_dtype,
    low_precision_policy,
    reference_output,
)
from harness.plugins import conformance

pytestmark = pytest.mark.cpu

DENOISE = AttentionLayout(2, 3, 1, "denoise")  # Q 4 x KV 5, span [2, 5)
LAYOUT = AttentionLayout(3, 8, 2, "prefill")  # Q 13 x KV 13
GQA_FACT = "every launch receives the 1 compressed key/value heads"


@pytest.fixture(autouse=True)
def _suite_kernels_only():
    """Under ``--impl attention=...`` compare_kernel judges the user's kernel, not the ones built here."""
    spec = conformance.active("attention")
    if spec is not None:
        pytest.skip(f"--impl attention={spec}: this test judges the suite's own kernels")


def test_formula_verdict_names_the_span_it_used():
    mask = masks.build_mask(DENOISE)
    detected = judge.formula_verdict(contract.verify_mask(mask))
    assert (detected.passed, detected.notes) == (True, ("ok: mask == formula with span (2, 5) elementwise",))
    assert detected.metrics == {"mismatches": 0, "total": 20, "first_mismatch": "no mismatch", "density": 0.85,
                                "detected_span": "(2, 5)"}
    one = judge.formula_verdict(contract.verify_mask(torch.ones(1, 1, dtype=torch.bool)))
    assert (one.passed, one.metrics["density"], one.metrics["detected_span"]) == (True, 1.0, "None")
    given = judge.formula_verdict(contract.verify_mask(mask, span=(3, 5)))
    assert not given.passed
    assert given.notes == ("VIOLATED: mask == formula with span (3, 5) elementwise",)
    assert given.metrics["first_mismatch"] == "first mismatch at query row 1, key 3"  # position 2 is causal there


def test_builder_verdict_names_the_first_pair_the_builder_gets_wrong():
    mask = masks.build_mask(DENOISE)
    agrees = judge.builder_verdict(mask, DENOISE)
    assert agrees.passed and agrees.metrics == {"builder_mismatches": 0, "builder_first_mismatch": "none"}
    mask[2, 0] = False
    one_off = judge.builder_verdict(mask, DENOISE)
    assert not one_off.passed
    assert one_off.metrics == {"builder_mismatches": 1, "builder_first_mismatch": "query row 2, key 0"}


def _expanding(query, key, value, layout, *, scale=None):
    """The dense reference, but with key/value repeated over the GQA groups before the launch."""
    heads = query.shape[1]
    return reference.masked_sdpa(query, reference.expand_kv(key, heads), reference.expand_kv(value, heads), layout,
                                 scale=scale)


def _spec(fn, *, gqa: bool) -> kernels.KernelSpec:
    sdpa = kernels.KERNELS["sdpa"]
    return dataclasses.replace(sdpa, name="t_kernel", fn=fn, gqa=gqa, under_test=True)


def _judge(spec, capture, **kwargs):
    expected = reference_output(capture)
    control = floor_control(capture, expected)
    return judge.compare_kernel(spec, capture, floor_policy(control), expected=expected,
                                 floor=kwargs.pop("floor", control), **kwargs)


def test_the_gqa_fact_is_required_on_gqa_captures_only():
    gqa = small_capture(LAYOUT, heads=2, kv_heads=1, head_dim=8, seed=2)
    plain = small_capture(LAYOUT, heads=2, kv_heads=2, head_dim=8, seed=2)
    ok = _judge(_spec(reference.masked_sdpa, gqa=True), gqa)
    assert ok.passed and f"ok: {GQA_FACT}" in ok.notes and ok.metrics["launch_kv_heads"] == "1"
    expanded = _judge(_spec(_expanding, gqa=True), gqa)  # the right numbers, the cache expanded
    assert expanded.violated_facts == [GQA_FACT] and expanded.metrics["launch_kv_heads"] == "2"
    non_gqa = _judge(_spec(reference.masked_sdpa, gqa=False), plain)  # a kernel without GQA on equal heads
    assert non_gqa.passed and "launch_kv_heads" not in non_gqa.metrics
    with pytest.raises(ValueError, match="kernel t_kernel does not claim GQA; .* 2 query heads over 1 key/value"):
        _judge(_spec(reference.masked_sdpa, gqa=False), gqa)


def _offset(query, key, value, layout, *, scale=None):
    """The dense reference, every output scaled by (1 + 2^-18): a relative difference this test makes itself
    (the suite's own kernels may agree with the reference bitwise on some hosts)."""
    return reference.masked_sdpa(query, key, value, layout, scale=scale) * (1.0 + 2.0**-18)


def test_the_relative_l2_bound_is_inclusive_and_optional():
    capture = small_capture(LAYOUT, heads=1, head_dim=8, seed=5)
    spec = _spec(_offset, gqa=False)
    expected = reference_output(capture)
    measured_abs = float((_offset(*capture.heads_first(), contract.detect_layout(capture.mask)) - expected).abs().max())
    control = FloorControl(measured_abs, 1e-9, "torch.float32", float(expected.abs().max()))

    def run(**kwargs):
        return judge.compare_kernel(spec, capture, floor_policy(control), expected=expected,
                                    floor=kwargs.pop("floor", control), **kwargs)

    free = run()
    assert free.passed and "rel_l2_bound" not in free.metrics
    measured = free.metrics["rel_l2"]
    assert measured > 2.0**-19  # the kernel's own 2^-18 offset
    floor = dataclasses.replace(control, rel_l2=measured / 4)
    at_bound = run(max_rel_l2=measured, floor=floor)
    assert at_bound.passed, at_bound.describe()
    assert at_bound.metrics["rel_l2_bound"] == measured
    below = run(max_rel_l2=measured * 0.75, floor=floor)
    assert below.violated_facts == [f"relative L2 {measured:.3e} <= {measured * 0.75:.3e}"]
    with pytest.raises(ValueError, match="max_rel_l2 needs floor=FloorControl"):
        run(max_rel_l2=measured, floor=floor.max_abs)


def test_compare_kernel_computes_the_reference_or_judges_against_the_given_one():
    capture = small_capture(LAYOUT, heads=1, head_dim=8, seed=6)
    control = floor_control(capture)
    verdict = judge.compare_kernel("decomposed", capture, floor_policy(control), floor=control)
    assert verdict.passed and verdict.metrics["kernel"] == "decomposed"
    wrong = reference_output(capture) + 1.0
    off = judge.compare_kernel("decomposed", capture, floor_policy(control), expected=wrong,
                                floor=control)
    assert not off.passed and off.metrics["max_abs"] == pytest.approx(1.0)


def test_a_kernel_verdict_names_the_dtype_its_inputs_ran_in():
    """The report's dtype column reads torch's own name of the inputs' dtype: fp32 and bf16 runs are told apart."""
    capture = small_capture(LAYOUT, heads=1, head_dim=8, seed=6)
    control = floor_control(capture)
    fp32 = judge.compare_kernel("decomposed", capture, floor_policy(control), floor=control)
    truth = reference_output(capture, torch.float64)
    bf16 = judge.compare_kernel("decomposed", in_dtype(capture, torch.bfloat16),
                                low_precision_policy(capture, torch.bfloat16, truth), expected=truth)
    assert (fp32.passed, bf16.passed) == (True, True), (fp32.describe(), bf16.describe())
    assert (fp32.metrics["dtype"], bf16.metrics["dtype"]) == ("float32", "bfloat16")


def test_under_impl_the_kernels_under_test_are_replaced_and_the_reference_is_not():
    capture = small_capture(LAYOUT, heads=2, head_dim=8, seed=7)
    impl = "fixtures.attention_user_kernels:attend"
    with conformance.applied({"attention": impl}):
        user, ref = _judge(kernels.KERNELS["decomposed"], capture), _judge(kernels.KERNELS["sdpa"], capture)
    assert user.passed and user.metrics["kernel"] == impl and user.metrics["impl_calls"] == 1
    assert f"ok: the implementation under test {impl} ran once" in user.notes
    assert ref.passed and ref.metrics["kernel"] == "sdpa" and "impl_calls" not in ref.metrics
    assert "launch_kv_heads" not in ref.metrics  # equal heads: no GQA fact to prove
