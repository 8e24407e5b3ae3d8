"""Kernel-vs-reference and contract comparisons as Verdicts; the CPU catalogue and the GPU tier
both call these with their own captures and policies.

The reference is masked SDPA on the capture's own mask (with key/value expanded over the GQA groups,
as the model's dense path does), so a kernel is judged against what the model computed, not against
the harness's own mask builder.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.attention import contract, kernels, masks, spy
from harness.attention.capture import Capture
from harness.attention.layout import AttentionLayout
from harness.attention.reference import attend_masked, expand_kv
from harness.compare import NoiseFloor, Policy, Verdict, expect, max_abs_diff, noise_floor, rel_l2

__all__ = [
    "FloorControl",
    "builder_verdict",
    "compare_kernel",
    "floor_control",
    "floor_policy",
    "formula_verdict",
    "reference_output",
    "rel_l2_bound",
]

OUTPUT_DIMS = ("batch", "head", "query row")


def reference_output(capture: Capture, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Masked SDPA of the capture under its own mask, (B, H, Q, D), optionally in another dtype."""
    q, k, v = capture.heads_first()
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = expand_kv(k, capture.heads), expand_kv(v, capture.heads)
    return attend_masked(q, k, v, capture.mask, scale=capture.scale)


@dataclass(frozen=True)
class FloorControl:
    """The reference's own error against an fp64 ground truth: the noise floor of its dtype."""

    max_abs: float
    rel_l2: float
    dtype: str


def floor_control(capture: Capture, reference: torch.Tensor | None = None) -> FloorControl:
    ref = reference_output(capture) if reference is None else reference
    truth = reference_output(capture, torch.float64)
    return FloorControl(max_abs_diff(ref.double(), truth), rel_l2(ref.double(), truth), str(ref.dtype))


def floor_policy(control: FloorControl, k: float = 4.0) -> NoiseFloor:
    """max|d| within k x the reference's own error against fp64 on the same capture.

    A kernel exactly as accurate as the reference differs from it by at most twice the reference's
    error (both lie within the floor of the truth); k = 4 leaves room for a kernel up to 3x less
    accurate (another reduction order, blockwise softmax), while one missed key at S ~ 5k moves
    outputs by ~1e-4, two orders of magnitude above the fp32 floor (~1e-7 .. 5e-7 measured).
    """
    reason = f"k x masked SDPA {control.dtype} vs fp64 on the same capture"
    return noise_floor(control.max_abs, k, metric="max_abs", reason=reason)


def rel_l2_bound(control: FloorControl, k: float = 4.0) -> float:
    """The relative-L2 twin of ``floor_policy``: k x the reference's own relative L2 vs fp64."""
    return k * control.rel_l2


def _policies(policy: Policy | Sequence[Policy]) -> list[Policy]:
    return [policy] if isinstance(policy, Policy) else list(policy)


def compare_kernel(kernel: kernels.KernelSpec | str, capture: Capture, policy: Policy | Sequence[Policy],
                   check_id: str, *, layout: AttentionLayout | None = None, expected: torch.Tensor | None = None,
                   max_rel_l2: float | None = None) -> Verdict:
    """Run ``kernel`` on ``capture`` and judge it against the capture's masked SDPA under ``policy``.

    ``layout`` defaults to the one detected in the capture's mask; ``expected`` lets a caller reuse a
    cached reference; ``max_rel_l2`` adds a relative-L2 bound. The verdict also requires the
    kernel's launch facts (and, for a GQA capture, that the compressed key/value heads reached it).
    """
    spec = kernels.get_kernel(kernel) if isinstance(kernel, str) else kernel
    gqa = capture.kv_heads < capture.heads
    if gqa and not spec.gqa:
        raise ValueError(f"kernel {spec.name} does not claim GQA; capture {capture.name} has "
                         f"{capture.heads} query heads over {capture.kv_heads} key/value heads")
    layout = contract.detect_layout(capture.mask) if layout is None else layout
    expected = reference_output(capture) if expected is None else expected
    q, k, v = capture.heads_first()
    with spy.recording() as launches:
        actual = spec(q, k, v, layout, scale=capture.scale)
    what = f"{spec.name} output on {capture.name}"
    judged = [p.judge(check_id, actual, expected, dims=OUTPUT_DIMS, what=what) for p in _policies(policy)]
    verdict = functools.reduce(Verdict.merge, judged)
    if max_rel_l2 is not None:
        measured = verdict.metrics["rel_l2"]
        verdict = verdict.require(measured <= max_rel_l2, f"relative L2 {measured:.3e} <= {max_rel_l2:.3e}",
                                  rel_l2_bound=max_rel_l2)
    for ok, fact, metrics in spec.proof(launches, layout, capture.mask[0, 0]):
        verdict = verdict.require(ok, fact, **metrics)
    if gqa:
        ok, fact, metrics = kernels.gqa_fact(launches, capture.kv_heads)
        verdict = verdict.require(ok, fact, **metrics)
    return verdict.with_metrics(kernel=spec.name, layout=layout.describe(), heads=capture.heads,
                                kv_heads=capture.kv_heads)


def _where(first: tuple[int, int] | None) -> str:
    return "none" if first is None else f"query row {first[0]}, key {first[1]}"


def formula_verdict(check_id: str, report: contract.ContractReport) -> Verdict:
    """Zero elementwise mismatches between a mask and the seed's formula (``contract.verify_mask``'s
    report: at the given span, else the detected one); the first mismatch is named in rows and keys."""
    used = report.span if report.span is not None else report.detected_span
    return expect(check_id, report.mismatches == 0, f"mask == formula with span {used} elementwise",
                  mismatches=report.mismatches, total=report.total, first_mismatch=report.where(),
                  density=report.density, detected_span=str(report.detected_span))


def builder_verdict(check_id: str, mask: torch.Tensor, layout: AttentionLayout) -> Verdict:
    """The harness's mask builder reproduces ``mask`` exactly for ``layout``."""
    grid = contract.mask_grid(mask)
    bad, first = contract.mask_mismatches(masks.build_mask(layout, device=grid.device), grid)
    return expect(check_id, bad == 0, f"build_mask({layout.describe()}) reproduces the mask",
                  builder_mismatches=bad, builder_first_mismatch=_where(first))
