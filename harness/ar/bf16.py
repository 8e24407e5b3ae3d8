"""The bf16 judge of batched AR: what padding legitimately changes, measured on stock code only.

In bf16 a row's logits move when its prompt is right-padded and its keys sit in a longer (masked) key axis:
SDPA's reductions run over a different length. A control that batches identical unpadded copies through the fast
path cannot see that rounding (and runs the code under test), so the bound would collapse to its floor. The
control here is stock code on the same row twice: B=1 on the unpadded prompt (``stock_generate``) against the
same prompt right-padded under its mask in a cache of the batch's length, at the batch's row count
(``stock_padded``, teacher-forced on the first run's tokens). Rule:

- per row, KL(B=1 || batched) over every step whose context both runs share (the common token prefix and the
  first divergent step) must be at most ``k`` x the largest padded-control KL over the rows, plus ``floor``;
- a row may diverge only where the B=1 top-1/top-2 log-prob margin at the divergent step is below
  ``flip_margin`` (a near-tie: rounding may pick either token).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.ar.loop import Rollout
from harness.compare import Verdict, noise_floor

__all__ = ["comparable_kl", "flips", "judge_bf16", "kl_rows", "padding_control"]


def kl_rows(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) over the last dim of logits, in float64 on the reference's device (a stock
    run's logits may sit on the accelerator while the reference rollout is on the CPU)."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    cand = torch.log_softmax(candidate_logits.to(ref.device, torch.float64), dim=-1)
    return (ref.exp() * (ref - cand)).sum(dim=-1)


def comparable_kl(reference: Rollout, fast: Rollout) -> tuple[torch.Tensor, list[int]]:
    """Per row, the largest KL over the steps whose context both runs share: every step of the common token
    prefix and the first divergent step. Returns the per-row maxima and the common prefixes."""
    prefix = ((reference.tokens == fast.tokens).long().cumprod(dim=1)).sum(dim=1).tolist()
    steps = reference.tokens.shape[1]
    kl = kl_rows(reference.logits, fast.logits)  # [B, N]
    worst = torch.stack([kl[row, : min(p + 1, steps)].max() for row, p in enumerate(prefix)])
    return worst, prefix


def flips(reference: Rollout, prefix: list[int]) -> tuple[list[bool], list[float]]:
    """At each row's first divergent step: did the top-1 flip, and B=1's top-1/top-2 log-prob margin there."""
    flipped, margins = [], []
    for row, p in enumerate(prefix):
        if p >= reference.tokens.shape[1]:
            flipped.append(False)
            margins.append(float("nan"))
            continue
        top2 = torch.log_softmax(reference.logits[row, p].double(), dim=-1).topk(2).values
        flipped.append(True)
        margins.append(float(top2[0] - top2[1]))
    return flipped, margins


@torch.no_grad()
def padding_control(backend: Any, prompts: list[torch.Tensor], reference: Rollout, width: int,
                    max_cache_len: int) -> torch.Tensor:
    """Per row, max over steps of KL(stock B=1 unpadded || stock right-padded to ``width`` in a cache of
    ``max_cache_len``, at the batch's row count and the row's own position), teacher-forced on the unpadded
    run's tokens (same contexts, every step comparable). The control runs the batch's GEMM shapes: in bf16 a
    kernel picked for another row count rounds differently, and that rounding is legitimate."""
    out = []
    for row, prompt in enumerate(prompts):
        count = int(reference.lengths[row])
        tokens = reference.tokens[row, :count].to(prompt.device)
        padded = backend.stock_padded(prompt, tokens, width, max_cache_len, rows=len(prompts), row=row)
        out.append(kl_rows(reference.logits[row, :count], padded).max())
    return torch.stack(out)


def judge_bf16(fast: Rollout, reference: Rollout, control: torch.Tensor, *, k: float,
               floor: float, flip_margin: float, dtype: torch.dtype) -> Verdict:
    """The bf16 rule (module docstring) as one verdict; per-row KL, controls, prefixes and margins in metrics."""
    kl, prefix = comparable_kl(reference, fast)
    bound_control = float(control.max())
    policy = noise_floor(bound_control, k=k, floor=floor,
                         reason=f"{dtype} KL(B=1 || batched) over each row's shared-context steps vs stock B=1 "
                                "unpadded against stock B=1 right-padded in a cache of the batch's length")
    verdict = policy.judge(kl, torch.zeros_like(kl), dims=("row",), what="KL(B=1 || batched)")
    flipped, margins = flips(reference, prefix)
    bad = [row for row, (f, m) in enumerate(zip(flipped, margins, strict=True)) if f and m >= flip_margin]
    return verdict.require(not bad, f"rows diverge only where the B=1 top-1/top-2 margin < {flip_margin}",
                           kl_per_row=[float(f"{float(v):.6g}") for v in kl],
                           padding_control_per_row=[float(f"{float(v):.6g}") for v in control],
                           common_prefix=prefix, diverged=flipped,
                           margin_at_divergence=[round(m, 4) for m in margins], unexplained_flips=bad)
