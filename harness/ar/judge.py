"""Turn a batched rollout and its B=1 reference into verdicts, in the AR PR's terms (docs/contracts.md).

Every case verdict carries the AR PR's report row as metrics (``tokens_equal``, ``logp_max_abs``,
``prefill_kv_max_abs``, ``slot0_max_abs``) and ``generated_kv_max_abs`` (the KV of every token a row fed back),
whichever quantity it judges, so a kill-matrix report prints the table the AR PR printed. Token verdicts read like
vLLM's ``check_logprobs_close``: the first divergence per row. These functions take the policies as arguments so the
GPU tier can reuse them with dtype-specific ones.

fp32 tolerances are TOLERANCE_K x a floor measured on stock code on the same model (harness.ar.policies,
never below one fp32 eps of the values' magnitude), and a verdict fails when its tolerance leaves
[K_MIN, K_MAX] x that floor (``require_floor_bounds``). bf16 is judged by the KL rule of ``judge_bf16`` (its
section below says why). ``judge_growth`` judges the per-step error curve over all decode steps against the
growth of a stock per-step floor curve (``batch_shape_control_logp``): a bug that starts below the worst-element
tolerance and compounds step by step is not judged like noise. That control runs stock code at the batch's
shape, so it is held under the ceiling rounding allows (harness.judging.floors): a stock path whose output depends on
what shares its batch fails there instead of widening the curve it is judged against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from harness.ar.loop import Rollout
from harness.ar.policies import FP32_EPS, K_MAX, K_MIN, TOLERANCE_K, ARPolicies, StockPrefillFloor, model_device
from harness.ar.spy import ARForwardSpy
from harness.judging import growth
from harness.judging.compare import Policy, Verdict, close, max_abs_diff, noise_floor
from harness.judging.floors import StockFloor, reduction_ceiling_ulps
from harness.judging.growth import GROWTH_BUDGET, growth_ratio

__all__ = [
    "GROWTH_BUDGET",
    "PADDING_SIDES",
    "DtypeControl",
    "batch_shape_control_logp",
    "case_row_metrics",
    "comparable_kl",
    "compare_case",
    "compare_cases",
    "divergences",
    "dtype_control",
    "dynamic_cache_batch",
    "fed_kv_rows",
    "flips",
    "format_case_row",
    "growth_ratio",
    "judge_bf16",
    "judge_generated_kv",
    "judge_growth",
    "judge_logp",
    "judge_low_precision",
    "judge_prefill_kv",
    "judge_slot0",
    "judge_tokens",
    "kl_rows",
    "kv_dtype_floor",
    "kv_spans",
    "layout_mismatch",
    "require_fed_kv",
    "require_floor_bounds",
    "require_layout",
    "require_path",
    "resolution_curve",
    "step_curve",
    "upcast",
]


def require_floor_bounds(verdict: Verdict, tolerance: float, floor: StockPrefillFloor, quantity: str) -> Verdict:
    """The tolerance a verdict was judged at must lie in [K_MIN, K_MAX] x the stock floor of ``quantity``."""
    stock = floor.stock_floor(quantity)
    verdict = verdict.require(math.isfinite(stock.value) and stock.value > 0,
                              f"stock {quantity} floor measured on {floor.backend} (finite, > 0)")
    return verdict.require_bounded(tolerance, stock, k_min=K_MIN, k_max=K_MAX, what=f"{quantity} atol")



# --------------------------------------------------------------------------------------------- metrics


def divergences(actual: torch.Tensor, expected: torch.Tensor) -> list[str]:
    """First divergence of every row: ``row 2 diverges at decode step 3: token 17 vs 41``."""
    lines = []
    for row in range(actual.shape[0]):
        bad = (actual[row] != expected[row]).nonzero()
        if bad.numel():
            k = int(bad[0])
            lines.append(f"row {row} diverges at decode step {k}: token {int(actual[row, k])} vs "
                         f"{int(expected[row, k])} (step 0 is read from the prefill)")
    return lines


def _common_prefix(actual: torch.Tensor, expected: torch.Tensor) -> list[int]:
    same = (actual == expected).long().cumprod(dim=1)
    return same.sum(dim=1).tolist()


def _padded_kv(rollout: Rollout, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``[B, layers, 2, H, longest span, hd]``: row i's KV over its logical slots ``spans[i]``, zero-padded on the
    slot axis."""
    longest = max((stop - start for start, stop in spans), default=0)
    rows = []
    for i, (start, stop) in enumerate(spans):
        kv = rollout.kv[i][..., start:stop, :]
        pad = torch.zeros(*kv.shape[:-2], longest - kv.shape[-2], kv.shape[-1], dtype=kv.dtype)
        rows.append(torch.cat([kv, pad], dim=-2))
    return torch.stack(rows)


def _padded_prefill_kv(rollout: Rollout) -> torch.Tensor:
    """``[B, layers, 2, H, max real_pos, hd]``, each row's prefill KV zero-padded on the slot axis."""
    return _padded_kv(rollout, [(0, int(n)) for n in rollout.real_pos.tolist()])


def kv_spans(fast: Rollout, ref: Rollout, part: str = "generated",
             fed: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Per row, the logical slots ``[start, stop)`` of ``part`` that both rollouts hold: ``"generated"`` from the
    row's prompt length on, ``"all"`` from 0; up to the fewer slots of the two, and with ``fed`` no further than the
    prompt and the row's first ``fed[i]`` generated tokens (those fed in a context both runs share)."""
    if part not in ("generated", "all"):
        raise ValueError(f"kv_spans part must be 'generated' or 'all', got {part!r}")
    spans = []
    for i, (a, b) in enumerate(zip(fast.kv, ref.kv, strict=True)):
        prompt = int(ref.real_pos[i])
        stop = min(a.shape[-2], b.shape[-2], math.inf if fed is None else prompt + int(fed[i]))
        start = prompt if part == "generated" else 0
        spans.append((start, max(start, stop)))
    return spans


def _generated_kv_max_abs(fast: Rollout, ref: Rollout) -> float:
    spans = kv_spans(fast, ref)
    return max_abs_diff(_padded_kv(fast, spans), _padded_kv(ref, spans))


def _slot0(rollout: Rollout) -> torch.Tensor:
    return torch.stack([kv[..., 0, :] for kv in rollout.kv])


def case_row_metrics(fast: Rollout, ref: Rollout) -> dict[str, Any]:
    """The AR PR's report row: tokens equal?, logp max|d|, prefill-KV max|d|, cache slot 0 max|d|."""
    return {
        "tokens_equal": bool(torch.equal(fast.tokens, ref.tokens)),
        "common_prefix": _common_prefix(fast.tokens, ref.tokens),
        "logp_max_abs": max_abs_diff(fast.logp, ref.logp),
        "prefill_kv_max_abs": max_abs_diff(_padded_prefill_kv(fast), _padded_prefill_kv(ref)),
        "slot0_max_abs": max_abs_diff(_slot0(fast), _slot0(ref)),
        "generated_kv_max_abs": _generated_kv_max_abs(fast, ref),
    }


def format_case_row(label: str, passed: bool, metrics: dict[str, Any] | None = None, raised: str = "",
                   note: str = "") -> str:
    """One row of the AR PR's harness output: ``[FAIL] label`` then tokens / logp / KV / slot 0 (and why)."""
    head = f"[{'PASS' if passed else 'FAIL'}] {label}"
    if raised:
        return f"{head}\n        raised {raised}"
    m = metrics or {}
    row = (f"{head}\n        tokens equal={m.get('tokens_equal')}  logp max|d|={m.get('logp_max_abs', math.nan):.3e}"
           f"  prefill-KV max|d|={m.get('prefill_kv_max_abs', math.nan):.3e}"
           f"  (cache slot 0 max|d|={m.get('slot0_max_abs', math.nan):.3e})")
    return f"{row}\n        {note}" if note else row


# --------------------------------------------------------------------------------------------- judges

_KV_DIMS = ("row", "layer", "kv", "head", "slot")
_KV_LABELS = {"kv": ("K", "V")}


def judge_tokens(fast: Rollout, ref: Rollout, policy: Policy) -> Verdict:
    verdict = policy.judge(fast.tokens, ref.tokens, dims=("row", "step"), what="tokens")
    lines = divergences(fast.tokens, ref.tokens)
    if lines:
        verdict = dataclasses.replace(verdict, message="\n".join(lines))
    return verdict


def judge_logp(fast: Rollout, ref: Rollout, policy: Policy) -> Verdict:
    return policy.judge(fast.logp, ref.logp, dims=("row", "step"), what="log_probs")


def judge_prefill_kv(fast: Rollout, ref: Rollout, policy: Policy) -> Verdict:
    return policy.judge(_padded_prefill_kv(fast), _padded_prefill_kv(ref), dims=_KV_DIMS,
                        labels=_KV_LABELS, what="prefill KV over [0, real_pos_i)")


def judge_slot0(fast: Rollout, ref: Rollout, policy: Policy) -> Verdict:
    return policy.judge(_slot0(fast), _slot0(ref), dims=_KV_DIMS[:4], labels=_KV_LABELS,
                        what="cache slot 0")


def fed_kv_rows(rollout: Rollout) -> list[str]:
    """Every row whose KV is not exactly its prompt's and its fed tokens' (each emitted token but the last), in
    words: ``row 2 holds 19 slots, its prompt and fed tokens 17``."""
    wrong = []
    for row, kv in enumerate(rollout.kv):
        want = int(rollout.real_pos[row]) + max(int(rollout.lengths[row]) - 1, 0)
        if kv.shape[-2] != want:
            wrong.append(f"row {row} holds {kv.shape[-2]} slots, its prompt and fed tokens {want}")
    return wrong


def require_fed_kv(verdict: Verdict, rollout: Rollout) -> Verdict:
    """Each row of ``rollout`` holds the KV of its prompt and of every token it fed back, and no more: a row that
    goes on writing after its EOS, or drops a token's KV, fails naming its slots."""
    wrong = fed_kv_rows(rollout)
    fact = "every row holds the KV of its prompt and of each token it fed, no more"
    return verdict.require(not wrong, f"{fact} ({'; '.join(wrong)})" if wrong else fact, kv_rows_wrong=len(wrong))


def judge_generated_kv(fast: Rollout, ref: Rollout, policy: Policy, fed: Sequence[int] | None = None) -> Verdict:
    """The KV of every generated token a row fed back, in logical order (token j of row i at slot
    ``real_pos_i + j``), over the tokens both rollouts fed (with ``fed``, each row's first ``fed[i]`` only), and the
    fast rollout holding exactly its fed tokens' KV (``require_fed_kv``)."""
    spans = kv_spans(fast, ref, "generated", fed)
    verdict = policy.judge(_padded_kv(fast, spans), _padded_kv(ref, spans), dims=(*_KV_DIMS[:4], "token"),
                           labels=_KV_LABELS, what="generated tokens' KV over [real_pos_i, real_pos_i + fed_i)")
    return require_fed_kv(verdict, fast)


_JUDGES: dict[str, tuple[Callable[[Rollout, Rollout, Policy], Verdict], str]] = {
    "tokens": (judge_tokens, "tokens"),
    "logp": (judge_logp, "logp"),
    "prefill_kv": (judge_prefill_kv, "kv"),
    "slot0": (judge_slot0, "slot0"),
    "generated_kv": (judge_generated_kv, "kv"),
}


_HEADLINES = {"tokens": "tokens_equal", "logp": "logp_max_abs", "prefill_kv": "prefill_kv_max_abs",
              "slot0": "slot0_max_abs", "generated_kv": "generated_kv_max_abs"}


def compare_case(what: str, fast: Rollout, ref: Rollout, policies: ARPolicies) -> Verdict:
    """Judge one quantity (``tokens``, ``logp``, ``prefill_kv``, ``slot0``, ``generated_kv``) of a case; attach the
    AR PR's row."""
    if what not in _JUDGES:
        raise ValueError(f"unknown ar comparison {what!r}; expected one of {sorted(_JUDGES)}")
    if fast.tokens.shape != ref.tokens.shape:
        raise ValueError(f"rollout shapes differ: fast {tuple(fast.tokens.shape)} vs ref {tuple(ref.tokens.shape)}")
    judge, policy_name = _JUDGES[what]
    verdict = judge(fast, ref, getattr(policies, policy_name))
    row = case_row_metrics(fast, ref)
    summary = (f"tokens {'equal' if row['tokens_equal'] else 'DIFFER'}, logp {row['logp_max_abs']:.1e}, "
               f"prefill-KV {row['prefill_kv_max_abs']:.1e}, slot0 {row['slot0_max_abs']:.1e}, generated-KV "
               f"{row['generated_kv_max_abs']:.1e} (max|d|)")
    # the row's headline is the quantity this check compares; the others stand beside it in ``quantities``
    verdict = dataclasses.replace(verdict, headline=_HEADLINES[what],
                                  metrics={**verdict.metrics, **row, "quantities": summary})
    floor = policies.floor
    if floor is not None and policy_name != "tokens":
        verdict = require_floor_bounds(verdict, verdict.tolerance or 0.0, floor, policy_name)
    return verdict


def compare_cases(whats: Sequence[str], fast: Rollout, ref: Rollout, policies: ARPolicies) -> Verdict:
    """Several quantities of one case as one verdict (``compare_case`` each, merged: the largest margin leads)."""
    if not whats:
        raise ValueError("compare_cases needs at least one quantity")
    verdict = compare_case(whats[0], fast, ref, policies)
    for what in whats[1:]:
        verdict = verdict.merge(compare_case(what, fast, ref, policies))
    return verdict


PADDING_SIDES = ("right", "left")


def layout_mismatch(spy: ARForwardSpy, padding_side: str) -> str:
    """What the model's prefill forward received, when its rows were not padded on ``padding_side`` (the layout the
    checks judge): a sentence naming both layouts and the rows; "" when they were (or nothing was padded)."""
    pads = spy.prefill_pads
    wrong = [row for row, side in enumerate(pads) if side not in ("none", padding_side)]
    if not wrong:
        return ""
    other = next(side for side in PADDING_SIDES if side != padding_side)
    where = {"left": "pads first", "right": "pads last", "inside": "pads inside the row"}
    found = ", ".join(f"row {row}: {where[pads[row]]}" for row in wrong)
    declare = (f"declare padding_side = {other!r} on the implementation (docs/extending.md)"
               if all(pads[row] == other for row in wrong) else "pad every row on one side")
    return (f"layout mismatch: these checks judge padding_side={padding_side!r} implementations, but the model's "
            f"prefill forward received rows padded otherwise ({found}); {declare}")


def dynamic_cache_batch(err: BaseException) -> str:
    """When ``err`` was raised inside a dynamic cache's ``update`` handed more than one row (upstream's
    ``HunyuanStaticCache(dynamic=True)`` trims to one row's length and asserts a batch of one): a sentence naming
    that; "" otherwise. The assertion itself carries no message, so a failing rollout would say nothing of why."""
    trace = err.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        owner = frame.f_locals.get("self")
        keys = frame.f_locals.get("key_states")
        if frame.f_code.co_name == "update" and getattr(owner, "dynamic", False) is True \
                and isinstance(keys, torch.Tensor) and keys.dim() and int(keys.shape[0]) > 1:
            return (f"a dynamic cache at B = {int(keys.shape[0])}: {type(owner).__name__}(dynamic=True) trims its KV "
                    "to one row's length and holds a batch of one only (it asserts B == 1 when it writes); a batched "
                    "rollout needs the static cache, and dynamic=True only at B == 1")
        trace = trace.tb_next
    return ""


def require_layout(verdict: Verdict, spy: ARForwardSpy, padding_side: str) -> Verdict:
    """The prefill rows reached the model padded on ``padding_side`` (the spy read them, given the pad id). A
    mismatch replaces the verdict's message with the one sentence naming it and leads its violated facts: a
    left-padding implementation judged as right-padded (or the reverse) diverges everywhere, and that wall of
    divergences says nothing of the cause."""
    if not any(side != "none" for side in spy.prefill_pads):
        return verdict
    mismatch = layout_mismatch(spy, padding_side)
    fact = f"the prefill rows reached the model {padding_side}-padded (padding_side={padding_side!r})"
    verdict = verdict.require(not mismatch, fact, prefill_padding=list(spy.prefill_pads))
    if not mismatch:
        return verdict
    return dataclasses.replace(verdict, message=mismatch, notes=(verdict.notes[-1], *verdict.notes[:-1]))


def require_path(verdict: Verdict, spy: ARForwardSpy, batch_size: int, padding_side: str | None = None) -> Verdict:
    """Prove the path that ran: every forward at the full batch, static cache at B > 1, dynamic at B == 1; with
    ``padding_side``, the prefill rows padded on that side (``require_layout``), and for the left-padded layout, whose
    prefill mask the implementation builds from the rows' 2-D mask, no query row of it without a key."""
    if padding_side is not None:
        verdict = require_layout(verdict, spy, padding_side)
    empty = spy.prefill_empty_queries if padding_side == "left" else None  # a right-padded batch's mask is the caller's
    if empty is not None:
        verdict = verdict.require(empty == 0, "every query row of the prefill mask admits a key (an all-False row is "
                                              "NaN under an eager -inf softmax, and its KV poisons the rows that read "
                                              "it)", empty_prefill_query_rows=empty)
    sizes = spy.batch_sizes
    verdict = verdict.require(bool(sizes) and all(s == batch_size for s in sizes),
                              f"every forward ran at batch size {batch_size}", forward_batch_sizes=sizes,
                              forwards=len(sizes))
    if batch_size > 1:
        return verdict.require(spy.static, "batched forwards wrote a static (preallocated) KV cache",
                               cache_static=spy.static)
    return verdict.require(spy.dynamic, "B=1 kept the stock dynamic (trimmed) cache", cache_dynamic=spy.dynamic)


# --------------------------------------------------------------------------------------------- growth

def step_curve(actual: torch.Tensor, expected: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean |actual - expected| per step of ``[B, N]`` log-probs over the rows that emitted that step (fp64;
    NaN stays NaN, a step no row emitted is NaN)."""
    if actual.shape != expected.shape or actual.dim() != 2:
        raise ValueError(f"step_curve needs two [B, N] tensors, got {tuple(actual.shape)} vs {tuple(expected.shape)}")
    emitted = (torch.arange(actual.shape[1])[None] < lengths.reshape(-1, 1).cpu()).double()
    diff = (actual.double().cpu() - expected.double().cpu()).abs()
    return torch.where(emitted > 0, diff, 0.0).sum(dim=0) / emitted.sum(dim=0)


def resolution_curve(reference: Rollout) -> torch.Tensor:
    """One fp32 eps at each step's mean |log-prob|: differences below it are the values' own spacing."""
    logp = reference.logp.double().abs()
    emitted = (torch.arange(logp.shape[1])[None] < reference.lengths[:, None]).double()
    return FP32_EPS * (logp * emitted).sum(dim=0) / emitted.sum(dim=0)


@torch.no_grad()
def batch_shape_control_logp(backend: Any, prompts: list[torch.Tensor], reference: Rollout, width: int,
                             max_cache_len: int) -> torch.Tensor:
    """Stock code only, at the fast path's shape: each prompt right-padded to ``width`` in every row of a
    ``len(prompts)``-row batch over a cache of ``max_cache_len`` slots (the batch's), teacher-forced on the
    reference tokens, read at the prompt's own row; the log-prob of those tokens ``[B, N]``. Its GEMMs have the
    batch's row count at every step, so the rounding a batch shape brings shows here without the fast path."""
    out = torch.zeros_like(reference.logp)
    device = model_device(backend)
    rows = len(prompts)
    for row, prompt in enumerate(prompts):
        count = int(reference.lengths[row])
        tokens = reference.tokens[row, :count]
        logits = backend.stock_padded(prompt.to(device), tokens.to(device), width, max_cache_len, rows=rows,
                                      row=row).cpu()
        out[row, :count] = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None])[:, 0].float()
    return out


def growth_control_floor(control_logp: torch.Tensor, reference: Rollout, terms: int) -> StockFloor:
    """The growth control's worst |d log-prob| against B=1 over every emitted step, with its ceiling: ``terms``
    reduction terms per log-prob (the model's Linear fan-ins, the keys, the vocabulary's log-sum-exp)."""
    emitted = torch.arange(reference.logp.shape[1])[None] < reference.lengths.reshape(-1, 1).cpu()
    diff = (control_logp.double().cpu() - reference.logp.double().cpu()).abs()
    measured = float(torch.where(emitted, diff, 0.0).max()) if bool(emitted.any()) else 0.0
    magnitude = float(torch.where(emitted, reference.logp.double().abs().cpu(), 0.0).max()) if bool(
        emitted.any()) else 0.0
    return StockFloor(measured, magnitude, 1.0, source="stock right-padded at the batch's row count and width vs "
                                                        "stock B=1, every emitted step",
                      ceiling_ulps=reduction_ceiling_ulps(max(terms, 1)),
                      ceiling_reason=f"K = {terms}: the model's Linear fan-ins, the keys and the vocabulary")


def judge_growth(fast: Rollout, reference: Rollout, control_logp: torch.Tensor,
                 budget: float = GROWTH_BUDGET, terms: int = 0) -> Verdict:
    """Per-step error of the batched log-probs vs B=1 (mean |d| over the rows that emitted the step, fp64)
    against the stock floor curve ``control_logp`` (``batch_shape_control_logp``: each prompt at the batch's
    shape through stock code), judged by ``harness.judging.growth.judge_growth``: both curves floored at the
    log-probs' fp32 resolution, the error's growth at most ``budget`` x the floor's. With ``terms`` (the reduction
    terms one log-prob accumulates) the control is held under its ceiling (``growth_control_floor``)."""
    if fast.logp.shape != reference.logp.shape or control_logp.shape != reference.logp.shape:
        raise ValueError(f"log-prob shapes differ: fast {tuple(fast.logp.shape)}, reference "
                         f"{tuple(reference.logp.shape)}, control {tuple(control_logp.shape)}")
    verdict = growth.judge_growth(
        step_curve(fast.logp, reference.logp, reference.lengths),
        step_curve(control_logp, reference.logp, reference.lengths), resolution_curve(reference),
        control="stock B=1 unpadded vs stock right-padded at the batch's row count and width in its cache, "
                "mean |d logp| per step", budget=budget)
    verdict = verdict.with_metrics(logp_max_abs=max_abs_diff(fast.logp, reference.logp))
    if terms:
        floor = growth_control_floor(control_logp, reference, terms)
        verdict = verdict.with_metrics(**floor.metrics()).require(not floor.above_ceiling, floor.ceiling_fact())
    tokens_equal = bool(torch.equal(fast.tokens, reference.tokens))
    return verdict.require(tokens_equal, "batched tokens equal B=1 on every step (every step's context shared)",
                           common_prefix=_common_prefix(fast.tokens, reference.tokens))


# --------------------------------------------------------------------------------------------- bf16

# The bf16 judge of batched AR: how far bf16 rounding alone moves this model, measured on stock code only.
#
# In bf16 a row's logits move when its prompt is right-padded, its keys sit in a longer (masked) key axis and its
# GEMMs run at another row count: reductions run in another order. How far two orderings of the same bf16
# computation may drift apart is bounded by how far each drifts from the exact result, and that is what the control
# measures: the same stock B=1 computation (unpadded, teacher-forced on the B=1 run's tokens) in bf16 and in fp32
# on the same weights upcast exactly (``dtype_control``). It varies the dtype and nothing else: no row shares its
# forward, no batch shape, no padding, so a stock path whose output depends on the batch composition (a B=1-only
# expert path, a batch statistic) cannot widen it. Rule:
#
# - per row, KL(B=1 || batched) over every step whose context both runs share (the common token prefix and the
#   first divergent step) must be at most ``k`` x that row's own dtype-control KL, plus ``floor``. Per row, not
#   against the rows' largest: a row whose bf16 run routes one token to another expert than fp32 does (a near tie
#   in a MoE router) has a control far above rounding, and would otherwise lend that bound to every row;
# - a row may diverge only where the B=1 top-1/top-2 log-prob margin at the divergent step is below
#   ``flip_margin`` (a near-tie: rounding may pick either token);
# - the control's worst |d log-prob| lies under its ceiling for ``terms`` reduction terms in bf16
#   (harness.judging.floors).


def kl_rows(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) over the last dim of logits, in float64 on the reference's device (a stock
    run's logits may sit on the accelerator while the reference rollout is on the CPU)."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    cand = torch.log_softmax(candidate_logits.to(ref.device, torch.float64), dim=-1)
    return (ref.exp() * (ref - cand)).sum(dim=-1)


def comparable_kl(reference: Rollout, fast: Rollout) -> tuple[torch.Tensor, list[int]]:
    """Per row, the largest KL over the steps whose context both runs share and both emitted: every step of the
    common token prefix and the first divergent step, none past either run's last token (a finished row's later
    logits are nobody's). Returns the per-row maxima and the common prefixes."""
    prefix = ((reference.tokens == fast.tokens).long().cumprod(dim=1)).sum(dim=1).tolist()
    emitted = torch.minimum(reference.lengths.cpu(), fast.lengths.cpu()).clamp_min(1).tolist()
    kl = kl_rows(reference.logits, fast.logits)  # [B, N]
    worst = torch.stack([kl[row, : min(p + 1, int(n))].max() for row, (p, n) in enumerate(zip(prefix, emitted,
                                                                                                strict=True))])
    return worst, prefix


def flips(reference: Rollout, prefix: list[int]) -> tuple[list[bool], list[float]]:
    """At each row's first divergent step: did the top-1 flip, and B=1's top-1/top-2 log-prob margin there. A row
    that went on after its B=1 run stopped diverged where no near-tie can explain it: an infinite margin."""
    flipped, margins = [], []
    for row, p in enumerate(prefix):
        if p >= reference.tokens.shape[1]:
            flipped.append(False)
            margins.append(float("nan"))
            continue
        if p >= int(reference.lengths[row]):
            flipped.append(True)
            margins.append(math.inf)
            continue
        top2 = torch.log_softmax(reference.logits[row, p].double(), dim=-1).topk(2).values
        flipped.append(True)
        margins.append(float(top2[0] - top2[1]))
    return flipped, margins


@contextlib.contextmanager
def upcast(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """``model``'s floating parameters and buffers held in ``dtype`` for the block, in place, and put back
    bitwise after (a bf16 or fp16 value is exact in fp32). Needs the model's memory again in ``dtype``."""
    saved = []
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            saved.append((tensor, tensor.data))
            tensor.data = tensor.data.to(dtype)
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


@dataclasses.dataclass(frozen=True)
class DtypeControl:
    """Per row, the largest KL(fp32 || low precision) of stock B=1 over its steps, and the worst |d log-prob| as a
    floor with its ceiling."""

    kl: torch.Tensor
    floor: StockFloor


@torch.no_grad()
def dtype_control(backend: Any, prompts: list[torch.Tensor], reference: Rollout, terms: int) -> DtypeControl:
    """Stock B=1 on each unpadded prompt, teacher-forced on the reference's tokens, in the model's dtype and in
    fp32 on the same weights (``upcast``): per row the largest KL(fp32 || model dtype) over its steps, and the
    worst |d log-prob| against its ceiling for ``terms`` reduction terms in the model's dtype."""
    dtype = next(backend.model.parameters()).dtype
    runs: dict[str, list[torch.Tensor]] = {"low": [], "high": []}
    for which in ("low", "high"):
        with upcast(backend.model) if which == "high" else contextlib.nullcontext():
            for row, prompt in enumerate(prompts):
                count = int(reference.lengths[row])
                tokens = reference.tokens[row, :count].to(prompt.device)
                length = int(prompt.numel())
                runs[which].append(backend.stock_padded(prompt, tokens, length, length + count).cpu())
    kl = torch.stack([kl_rows(high, low).max() for high, low in zip(runs["high"], runs["low"], strict=True)])
    high = [torch.log_softmax(h.double(), -1) for h in runs["high"]]
    low = [torch.log_softmax(lo.double(), -1) for lo in runs["low"]]
    measured = max(float((h - lo).abs().max()) for h, lo in zip(high, low, strict=True))
    magnitude = max(float(h.abs().max()) for h in high)
    floor = StockFloor(measured, magnitude, 1.0, dtype=dtype, control="dtype",
                       source=f"stock B=1 unpadded in {str(dtype).removeprefix('torch.')} vs fp32, every step",
                       ceiling_ulps=reduction_ceiling_ulps(max(terms, 1)),
                       ceiling_reason=f"K = {terms}: the model's Linear fan-ins, the keys and the vocabulary")
    return DtypeControl(kl, floor)


def judge_bf16(fast: Rollout, reference: Rollout, control: DtypeControl, *, k: float,
               floor: float, flip_margin: float, dtype: torch.dtype) -> Verdict:
    """The bf16 rule (the section above) as one verdict; per-row KL, controls, prefixes and margins in metrics."""
    kl, prefix = comparable_kl(reference, fast)
    row_control = control.kl.to(kl)
    bounds = k * row_control + floor
    ratios = torch.where(bounds > 0, kl / bounds.clamp_min(torch.finfo(kl.dtype).tiny),
                         torch.where(kl > 0, torch.inf, 0.0))
    worst = int(torch.argmax(ratios))  # the row nearest its own bound: every row passes when it does
    policy = noise_floor(float(row_control[worst]), k=k, floor=floor,
                         reason=f"per row, {dtype} KL(B=1 || batched) over its shared-context steps vs that row's "
                                f"dtype control, KL(fp32 || {dtype}) of the same stock B=1 computation")
    verdict = policy.judge(kl[worst:worst + 1], torch.zeros_like(kl[worst:worst + 1]), dims=("row",),
                           what=f"KL(B=1 || batched) of row {worst}")
    flipped, margins = flips(reference, prefix)
    bad = [row for row, (f, m) in enumerate(zip(flipped, margins, strict=True)) if f and m >= flip_margin]
    verdict = verdict.with_metrics(**control.floor.metrics()).require(not control.floor.above_ceiling,
                                                                      control.floor.ceiling_fact())
    return verdict.require(not bad, f"rows diverge only where the B=1 top-1/top-2 margin < {flip_margin}",
                           kl_per_row=[float(f"{float(v):.6g}") for v in kl],
                           dtype_control_per_row=[float(f"{float(v):.6g}") for v in control.kl],
                           bound_per_row=[float(f"{float(v):.6g}") for v in bounds], worst_row=worst,
                           common_prefix=prefix, diverged=flipped,
                           margin_at_divergence=[round(m, 4) for m in margins], unexplained_flips=bad)


@torch.no_grad()
def kv_dtype_floor(backend: Any, prompts: list[torch.Tensor], reference: Rollout, terms: int) -> StockFloor:
    """How far the model's dtype alone moves its KV: each unpadded prompt and the tokens its B=1 reference fed,
    prefilled by stock code at B=1 in the model's dtype and in fp32 on the same weights (``upcast``); the worst
    |d KV| over every row, layer and slot, at the fp32 KV's magnitude, against its ceiling for ``terms`` reduction
    terms in the model's dtype. Like ``dtype_control`` it varies the dtype and nothing else."""
    dtype = next(backend.model.parameters()).dtype
    runs: dict[str, list[torch.Tensor]] = {"low": [], "high": []}
    for which in ("low", "high"):
        with upcast(backend.model) if which == "high" else contextlib.nullcontext():
            for row, prompt in enumerate(prompts):
                fed = reference.tokens[row, : max(int(reference.lengths[row]) - 1, 0)].to(prompt.device)
                runs[which].append(backend.stock_prefill(torch.cat([prompt, fed])[None])[1])
    measured = max(max_abs_diff(low, high) for low, high in zip(runs["low"], runs["high"], strict=True))
    magnitude = max(float(high.abs().max()) for high in runs["high"])
    return StockFloor(measured, magnitude, 1.0, dtype=dtype, control="dtype",
                      source=f"KV of stock B=1 unpadded prefills of each prompt and its fed tokens in "
                             f"{str(dtype).removeprefix('torch.')} vs fp32",
                      ceiling_ulps=reduction_ceiling_ulps(max(terms, 1)),
                      ceiling_reason=f"K = {terms}: the model's Linear fan-ins and the keys")


def judge_low_precision(fast: Rollout, reference: Rollout, control: DtypeControl, kv_floor: StockFloor, *,
                        k: float, floor: float, flip_margin: float, kv_k: float = TOLERANCE_K) -> Verdict:
    """A rollout in a low-precision dtype against B=1: ``judge_bf16`` over the logits (each row's KL against its own
    dtype control, flips only at near-ties) and, over each row's prompt and the tokens fed in a context both runs
    share (its common token prefix), the KV within ``kv_k`` x the KV's dtype control (``kv_dtype_floor``), that
    tolerance held in [K_MIN, K_MAX] x the control and the control under its ceiling; every row holding exactly
    its fed tokens' KV (``require_fed_kv``)."""
    dtype = kv_floor.dtype
    verdict = judge_bf16(fast, reference, control, k=k, floor=floor, flip_margin=flip_margin, dtype=dtype)
    if not (math.isfinite(kv_floor.value) and kv_floor.value > 0):
        raise ValueError(f"the KV dtype control measured {kv_floor.value!r}: the stock run must be finite to derive "
                         f"a {dtype} tolerance from it")
    atol = kv_k * kv_floor.value
    policy = close(atol=atol, rtol=0.0, reason=f"{str(dtype).removeprefix('torch.')}: {kv_k:g} x the KV's dtype "
                                                f"control, {kv_floor.describe()}")
    spans = kv_spans(fast, reference, "all", verdict.metrics["common_prefix"])
    kv = policy.judge(_padded_kv(fast, spans), _padded_kv(reference, spans), dims=_KV_DIMS, labels=_KV_LABELS,
                      what="KV of the prompt and of each token fed in a context both runs share")
    kv = kv.require_bounded(atol, kv_floor, k_min=K_MIN, k_max=K_MAX, what="KV atol")
    kv_metrics = {f"kv_{name}": value for name, value in kv_floor.metrics().items()}
    merged = verdict.merge(kv).with_metrics(**control.floor.metrics(), **kv_metrics,
                                            kv_max_abs=max_abs_diff(_padded_kv(fast, spans),
                                                                    _padded_kv(reference, spans)))
    return require_fed_kv(merged, fast)
