"""Kernels come from the plugin registry and are judged one way, at any block size, shipped or not;
--impl puts a user's kernel under test; bounds are multiples of a measured floor, from both sides."""

from __future__ import annotations

import pytest
import torch

from fixtures.attention_captures import small_capture
from harness.attention import judge, kernels, primitives, reference
from harness.attention.capture import CAPTURE_KIND
from harness.attention.layout import AttentionLayout
from harness.attention.policies import (
    K_MAX,
    K_MIN,
    floor_control,
    floor_policy,
    in_dtype,
    low_precision_policy,
    reference_output,
)
from harness.judging import ablation, catalogue
from harness.judging.compare import noise_floor
from harness.plugins import conformance
from harness.plugins import entry_points as plugins

pytestmark = pytest.mark.cpu

# Q 67 x KV 67: pads to 128 at block 64 and at block 128; denoise Q 51 x KV 60 pads to 64 / 128.
PREFILL = AttentionLayout(7, 56, 4, "prefill")
DENOISE = AttentionLayout(7, 53, 3, "denoise")


@pytest.fixture(autouse=True)
def _suite_kernels_only():
    """Under ``--impl attention=...`` these tests would judge the user's kernel against the suite's ablations."""
    spec = conformance.active("attention")
    if spec is not None:
        pytest.skip(f"--impl attention={spec}: this test judges the suite's own kernels and ablations")


def _judge(kernel, capture, *, block=kernels.BLOCK, policy=None, floor=None):
    expected = reference_output(capture)
    control = floor_control(capture, expected)
    policy = floor_policy(control) if policy is None else policy
    return judge.compare_kernel(kernel, capture, policy, block=block, expected=expected,
                                 floor=control.max_abs if floor is None else floor)


def test_register_adds_the_shipped_kernels_and_the_capture_kind_idempotently():
    kernels.register(plugins)
    kernels.register(plugins)
    assert set(kernels.KERNELS) <= set(plugins.ATTENTION_KERNELS.names())
    assert plugins.ATTENTION_KERNELS.origin("flex") == kernels.ORIGIN
    assert plugins.CHECKPOINT_KINDS.get("attention_capture") is CAPTURE_KIND
    assert (CAPTURE_KIND.feeds, CAPTURE_KIND.source) == ("attention", "files")


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("layout", [PREFILL, DENOISE], ids=["prefill", "denoise"])
@pytest.mark.parametrize("kernel", ["flex", "block_padded"])
def test_block_tiled_kernels_pass_numbers_and_launch_proofs_at_each_block(kernel, layout, block):
    verdict = _judge(kernel, small_capture(layout, heads=2, kv_heads=1, head_dim=16, seed=block), block=block)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["block"] == block
    if kernel == "block_padded":
        assert verdict.metrics["padded_q"] % block == 0 and verdict.metrics["padded_kv"] % block == 0
    else:
        assert verdict.metrics["block_mask_tiles"] == f"{block}x{block}"


def test_a_proof_at_the_wrong_block_fails_on_its_fact():
    capture = small_capture(DENOISE, heads=1, head_dim=16)
    catalogue.load()
    with ablation.get("attention.block_size_ignored").apply():
        verdict = _judge("block_padded", capture, block=64)
    assert not verdict.passed and verdict.margin <= 1  # the numbers pass; the tiling fact does not
    assert any("block-aligned (64)" in fact for fact in verdict.violated_facts)


def _chunked(query, key, value, layout, *, scale=None, rows: int = 16):
    """A third-party kernel: query rows in chunks, each under its slice of the dense mask."""
    from harness.attention import masks

    reference.check_inputs(query, key, value, layout)
    mask = masks.build_mask(layout, device=query.device)
    scale = reference.resolve_scale(query, scale)
    return torch.cat([primitives.sdpa(query[:, :, i:i + rows], key, value, attn_mask=mask[i:i + rows], scale=scale)
                      for i in range(0, layout.q_len, rows)], dim=2)


def _chunk_proof(launches, layout, mask, block):
    return [(len(launches) == -(-layout.q_len // 16), "one sdpa launch per 16 query rows",
             {"launches": len(launches)})]


def test_a_third_party_kernel_from_the_registry_is_judged_like_a_shipped_one():
    spec = kernels.KernelSpec("chunked_test", _chunked, True, lambda lay, block: lay.q_len * lay.kv_len,
                              _chunk_proof, "dense mask in row chunks")
    plugins.ATTENTION_KERNELS.register("chunked_test", spec, origin="tests")
    try:
        capture = small_capture(PREFILL, heads=4, kv_heads=2, head_dim=16, seed=1)
        verdict = _judge("chunked_test", capture)
        assert verdict.passed, verdict.describe()
        assert "ok: one sdpa launch per 16 query rows" in verdict.notes
        assert any("compressed key/value heads" in note for note in verdict.notes)  # the GQA fact applies too
        catalogue.load()
        with ablation.get("attention.span_start_off_by_one").apply():
            assert _judge("chunked_test", capture).margin > 1
    finally:
        plugins.ATTENTION_KERNELS.unregister("chunked_test")


def test_a_registered_bare_callable_is_judged_on_its_numbers_and_a_non_callable_is_named():
    plugins.ATTENTION_KERNELS.register("bare_test", _chunked, origin="tests")
    plugins.ATTENTION_KERNELS.register("broken_test", "not a kernel", origin="tests")
    try:
        capture = small_capture(DENOISE, heads=2, kv_heads=1, head_dim=16, seed=4)
        assert _judge("bare_test", capture).passed
        catalogue.load()
        with ablation.get("attention.span_end_off_by_one").apply():
            assert _judge("bare_test", capture).margin > 1
        with pytest.raises(TypeError, match="'broken_test' .*must be a .*KernelSpec or a callable"):
            kernels.get_kernel("broken_test")
    finally:
        plugins.ATTENTION_KERNELS.unregister("bare_test")
        plugins.ATTENTION_KERNELS.unregister("broken_test")


@pytest.mark.parametrize(("spec", "passes"), [("fixtures.attention_user_kernels:attend", True),
                                              ("fixtures.attention_user_kernels:attend_causal_only", False)])
def test_impl_puts_the_user_kernel_under_test_for_every_fast_kernel(spec, passes):
    capture = small_capture(DENOISE, heads=2, kv_heads=1, head_dim=16, seed=3)
    try:  # (skipped under a real --impl, whose spec clear() would drop)
        conformance.use("attention", spec)
        for kernel in ("decomposed", "flex", "block_padded"):
            verdict = _judge(kernel, capture)
            assert verdict.passed is passes, verdict.describe()
            assert verdict.metrics["kernel"] == spec and verdict.metrics["impl_calls"] == 1
            if not passes:
                assert verdict.margin > 1  # caught by the numbers
        reference_verdict = _judge("sdpa", capture)  # the reference is never replaced
        assert reference_verdict.passed and reference_verdict.metrics["kernel"] == "sdpa"
    finally:
        conformance.clear()


def test_bounds_are_multiples_of_the_measured_floor_from_both_sides():
    capture = small_capture(PREFILL, heads=1, head_dim=16, seed=2)
    control = floor_control(capture)
    loose = _judge("flex", capture, policy=floor_policy(control, k=K_MAX * 2))
    assert not loose.passed and any("too loose" in f for f in loose.violated_facts)
    tight = _judge("flex", capture, policy=floor_policy(control, k=K_MIN / 2))
    assert not tight.passed and any("too tight" in f for f in tight.violated_facts)
    fixed = _judge("flex", capture, policy=noise_floor(1e-3), floor=control.max_abs)  # a fixed atol, unmeasured
    assert not fixed.passed and any("too loose" in f for f in fixed.violated_facts)
    assert _judge("flex", capture).metrics["bound_floor_multiple"] == pytest.approx(4.0)


def test_row_scaled_bf16_bound_kills_the_span_end_off_by_one_a_whole_output_bound_lets_pass():
    """Text rows ~14x the image rows; the old bound (2 x bf16 SDPA's max error + one bf16 step
    of the whole output's max) is set by the text rows, the row-scaled one by each row."""
    layout = AttentionLayout(120, 256, 3, "prefill")
    capture = small_capture(layout, heads=2, head_dim=32, seed=0)
    truth, ref32 = reference_output(capture, torch.float64), reference_output(capture)
    low = in_dtype(capture, torch.bfloat16)
    scale = truth.abs().amax(-1)
    assert float(scale[..., :layout.text_len].max() / scale[..., layout.text_len:].median()) > 10
    control = float((reference_output(low).double() - ref32.double()).abs().max())
    whole_output = noise_floor(control, k=2.0, floor=2.0**-8 * float(ref32.abs().max()))
    row_scaled = low_precision_policy(capture, torch.bfloat16, truth)
    catalogue.load()
    with ablation.get("attention.span_end_off_by_one").apply():
        new = judge.compare_kernel("flex", low, row_scaled, layout=layout, expected=truth)
        old = whole_output.judge(kernels.get_kernel("flex")(*low.heads_first(), layout,
                                                                              scale=low.scale), ref32)
    assert new.margin >= 10 and new.margin > 4 * old.margin, (new.margin, old.margin)


def test_under_impl_a_users_kernel_is_judged_once_per_input_not_once_per_kernel_name():
    """--impl attention puts one kernel behind every kernel name: each input's check under the first name is judged,
    every other name's (and the other block size's) is deselected, naming the check that judges that input."""
    from harness.judging import checks
    from harness.plugins import conformance
    from parity import attention_checks

    ids = [c.id for c in checks.all_checks() if c.id.startswith("attention.") and c.id.endswith(".vs_sdpa")]
    judged = [i for i in ids if conformance.judged_by(i) is None]
    first = attention_checks.FAST_KERNELS[0]
    assert judged and all(f".{first}.vs_sdpa" in i for i in judged), judged
    inputs = {i.split(".")[1] for i in ids}
    assert {i.split(".")[1] for i in judged} == inputs and len(judged) == len(inputs)  # one check per input
    assert conformance.judged_by("attention.prefill.flex.vs_sdpa").startswith(
        f"the same input as attention.prefill.{first}.vs_sdpa: your one kernel stands in for every kernel name")
    assert "takes no block size" in conformance.judged_by("attention.denoise.block_padded.block64.vs_sdpa")
