"""Kernel-vs-reference and contract comparisons as Verdicts; the CPU catalogue and the GPU tier
both call these with their own captures and policies.

The reference is masked SDPA on the capture's own mask (with key/value expanded over the GQA groups,
as the model's dense path does), so a kernel is judged against what the model computed, not against
the harness's own mask builder.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from harness.attention import contract, kernels, masks, spy
from harness.attention.capture import Capture
from harness.attention.layout import AttentionLayout
from harness.attention.policies import (
    K_MAX,
    K_MIN,
    FloorControl,
    bounded,
    floor_control,
    floor_policy,
    reference_output,
    rel_l2_bound,
)
from harness.judging.compare import Policy, Verdict, holds
from harness.plugins import conformance

__all__ = [
    "OUTPUT_DIMS",
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


def _policies(policy: Policy | Sequence[Policy]) -> list[Policy]:
    return [policy] if isinstance(policy, Policy) else list(policy)


def _kernel_under_test(spec: kernels.KernelSpec, block: int) -> tuple[kernels.reference.Kernel, str | None]:
    """The callable to judge: the spec at ``block``, or the user's ``--impl attention=...`` in its place."""
    default = spec.bind(block)
    if not spec.under_test:
        return default, None
    return conformance.resolve("attention", default), conformance.active("attention")


def compare_kernel(kernel: kernels.KernelSpec | str, capture: Capture, policy: Policy | Sequence[Policy],
                   *, block: int = kernels.BLOCK, layout: AttentionLayout | None = None,
                   expected: torch.Tensor | None = None, max_rel_l2: float | None = None,
                   floor: FloorControl | float | None = None, pass_scale: bool = True) -> Verdict:
    """Run ``kernel`` (a registered name or a KernelSpec) on ``capture`` at ``block`` and judge it
    against the capture's masked SDPA under ``policy``.

    ``layout`` defaults to the one detected in the capture's mask; ``expected`` lets a caller reuse a
    cached reference; ``max_rel_l2`` adds a relative-L2 bound; ``floor`` is the floor measured on stock
    code that every bound must stay within [K_MIN, K_MAX] of (a FloorControl bounds max|d| and the
    relative L2; a float bounds max|d|; a row-scaled policy carries its own control). The verdict
    also requires the kernel's launch facts at ``block`` (and, for a GQA capture, that the compressed
    key/value heads reached every launch). ``pass_scale=False`` calls the kernel with ``scale=None``
    (the capture's scale must then be the default 1 / sqrt(D)). Under ``--impl attention=MOD:FN`` the
    user's callable replaces every kernel under test and must be seen to run.
    """
    spec = kernels.get_kernel(kernel) if isinstance(kernel, str) else kernel
    block = kernels.check_block(block)
    gqa = capture.kv_heads < capture.heads
    if gqa and not spec.gqa:
        raise ValueError(f"kernel {spec.name} does not claim GQA; capture {capture.name} has "
                         f"{capture.heads} query heads over {capture.kv_heads} key/value heads")
    layout = contract.detect_layout(capture.mask) if layout is None else layout
    expected = reference_output(capture) if expected is None else expected
    fn, impl = _kernel_under_test(spec, block)
    q, k, v = capture.heads_first()
    if not pass_scale and capture.scale != q.shape[-1] ** -0.5:
        raise ValueError(f"scale=None means 1 / sqrt({q.shape[-1]}), but capture {capture.name} was computed at "
                         f"scale {capture.scale}")
    calls_before = conformance.calls("attention")
    with spy.recording() as launches:
        actual = fn(q, k, v, layout, scale=capture.scale if pass_scale else None)
    name = spec.name if impl is None else impl
    what = f"{name} output on {capture.name}"
    judged = [p.judge(actual, expected, dims=OUTPUT_DIMS, what=what) for p in _policies(policy)]
    verdict = functools.reduce(Verdict.merge, judged)
    verdict = verdict.require(actual.dtype == q.dtype and tuple(actual.shape) == tuple(q.shape),
                              "the output is (B, H, Q, D) in the inputs' dtype",
                              output=f"{tuple(actual.shape)} {str(actual.dtype).split('.')[-1]}")
    max_abs_floor = floor.max_abs_floor() if isinstance(floor, FloorControl) else floor
    for p in _policies(policy):
        verdict = bounded(verdict, p, max_abs_floor)
    if max_rel_l2 is not None:
        measured = verdict.metrics["rel_l2"]
        verdict = verdict.require(measured <= max_rel_l2, f"relative L2 {measured:.3e} <= {max_rel_l2:.3e}",
                                  rel_l2_bound=max_rel_l2)
        if not isinstance(floor, FloorControl):
            raise ValueError("max_rel_l2 needs floor=FloorControl: its stock relative L2 bounds it from both sides")
        verdict = verdict.require_bounded(max_rel_l2, floor.rel_l2_floor(), k_min=K_MIN, k_max=K_MAX,
                                          what="relative L2 bound")
    if impl is not None:
        ran = conformance.calls("attention") - calls_before
        verdict = verdict.require(ran == 1, f"the implementation under test {impl} ran once", impl_calls=ran)
    elif spec.records_launches:
        for ok, fact, metrics in spec.proof(launches, layout, capture.mask[0, 0], block):
            verdict = verdict.require(ok, fact, **metrics)
        if gqa:
            ok, fact, metrics = kernels.gqa_fact(launches, capture.kv_heads)
            verdict = verdict.require(ok, fact, **metrics)
    return verdict.with_metrics(kernel=name, block=block, layout=layout.describe(), heads=capture.heads,
                                kv_heads=capture.kv_heads, scale="given" if pass_scale else "None",
                                dtype=str(q.dtype).split(".")[-1])


def _where(first: tuple[int, int] | None) -> str:
    return "none" if first is None else f"query row {first[0]}, key {first[1]}"


def formula_verdict(report: contract.ContractReport) -> Verdict:
    """Zero elementwise mismatches between a mask and the seed's formula (``contract.verify_mask``'s
    report: at the given span, else the detected one); the first mismatch is named in rows and keys."""
    used = report.span if report.span is not None else report.detected_span
    return holds(report.mismatches == 0, f"mask == formula with span {used} elementwise",
                 mismatches=report.mismatches, total=report.total, first_mismatch=report.where(),
                 density=report.density, detected_span=str(report.detected_span))


def builder_verdict(mask: torch.Tensor, layout: AttentionLayout) -> Verdict:
    """The harness's mask builder reproduces ``mask`` exactly for ``layout``."""
    grid = contract.mask_grid(mask)
    bad, first = contract.mask_mismatches(masks.build_mask(layout, device=grid.device), grid)
    return holds(bad == 0, f"build_mask({layout.describe()}) reproduces the mask",
                 builder_mismatches=bad, builder_first_mismatch=_where(first))
