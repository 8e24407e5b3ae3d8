"""Tolerance policies of the ar path: the stock floors they stand on and the policy sets a case is judged under.

fp32 tolerances are TOLERANCE_K x a floor measured on stock code on the same model (``stock_prefill_floor``,
never below one fp32 eps of the values' magnitude), and a verdict fails when its tolerance leaves
[K_MIN, K_MAX] x that floor (harness.ar.judge.require_floor_bounds). B=1 through upstream's own dynamic path is
judged bitwise (``exact_policies``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from harness.judging.compare import Policy, close, exact, max_abs_diff
from harness.judging.floors import StockFloor, module_reduction_terms, reduction_ceiling_ulps

__all__ = [
    "BF16_KL_FLOOR",
    "BF16_KL_K",
    "FLIP_MARGIN",
    "FLOOR_ULPS",
    "FP32_EPS",
    "K_MAX",
    "K_MIN",
    "TOLERANCE_K",
    "ARPolicies",
    "StockPrefillFloor",
    "exact_policies",
    "fp32_policies",
    "fp32_tolerance",
    "model_device",
    "stock_prefill_floor",
]


FP32_EPS = float(torch.finfo(torch.float32).eps)

# fp32 tolerance = TOLERANCE_K x the stock floor, and any tolerance a verdict is judged at must lie in
# [K_MIN, K_MAX] x that floor ("too tight" / "too loose"). Measured on the tiny CPU models (1 thread): the
# batched-vs-B=1 errors reach 1.4x (logp) and 1.2x (KV) of the floor, so 8x leaves ~6x headroom and a bug of
# 16 floors cannot hide under a policy.
TOLERANCE_K = 8.0
K_MIN, K_MAX = 4.0, 16.0


# A low-precision rollout (bf16) is judged by the KL rule of harness.ar.judge.judge_bf16: each row's KL(B=1 ||
# batched) at most BF16_KL_K x that row's own dtype control (the same stock B=1 computation in bf16 and in fp32)
# plus BF16_KL_FLOOR, and a row may diverge only where B=1's top-1/top-2 log-prob gap is below FLIP_MARGIN.
BF16_KL_K = 8.0  # the AR PR saw mixed-length KL up to ~4.1 x its no-padding control; 2x headroom over that
BF16_KL_FLOOR = 1e-3  # nats: below this a KL is rounding whatever the control says
FLIP_MARGIN = 1.0  # a top-1 flip is benign only where B=1's top-1/top-2 log-prob gap is below this (seed: 0.31)


# The floor's stated minimum: one fp32 ulp at the compared values' own magnitude (max |log-prob|, max |KV|). A
# measured floor of exactly zero is legitimate (the batched and alone GEMMs share kernels on some hosts); the
# tolerance then rests on the values' own spacing, TOLERANCE_K ulps of their magnitude.
FLOOR_ULPS = 1.0


@dataclass(frozen=True)
class StockPrefillFloor:
    """The fp32 rounding a batch shape alone causes: the same prompts prefilled batched vs one by one.

    ``logp`` / ``kv`` are the measured max|d| (0 where the batched and alone GEMMs share kernels); ``logp_scale``
    / ``kv_scale`` are the stock run's max |log-prob| / |KV|; ``rows`` x ``length`` is the batch it prefilled (the
    fast path's row count and width). The floor is the larger of the measurement and FLOOR_ULPS fp32 ulps at
    that magnitude (``stock_floor``), so k x floor never collapses.
    """

    logp: float
    kv: float
    backend: str
    logp_scale: float
    kv_scale: float
    rows: int = 4
    length: int = 6
    terms: int = 0  # reduction terms one log-prob accumulates (0: no ceiling stated)

    def stock_floor(self, quantity: str) -> StockFloor:
        """The floor of ``"logp"`` or ``"kv"`` (slot 0 is KV) with its stated minimum and its ceiling."""
        source = f"{self.rows} unpadded {self.length}-token prompts prefilled together vs alone"
        ceiling = reduction_ceiling_ulps(self.terms) if self.terms else math.inf
        why = (f"K = {self.terms}: the model's Linear fan-ins, {self.length} keys and the vocabulary's log-sum-exp"
               if self.terms else "")
        if quantity == "logp":
            return StockFloor(self.logp, self.logp_scale, FLOOR_ULPS, source=source, ceiling_ulps=ceiling,
                              ceiling_reason=why)
        if quantity in ("kv", "slot0"):
            return StockFloor(self.kv, self.kv_scale, FLOOR_ULPS, source=source, ceiling_ulps=ceiling,
                              ceiling_reason=why)
        raise ValueError(f"a stock floor is measured for 'logp' or 'kv', got {quantity!r}")

    def floor(self, quantity: str) -> float:
        """The floor value of ``quantity``: max(measured, FLOOR_ULPS fp32 ulps x magnitude)."""
        return self.stock_floor(quantity).value

    def describe(self, quantity: str | None = None) -> str:
        parts = []
        for name in ("logp", "KV"):
            if quantity is None or name.lower() == ("kv" if quantity == "slot0" else quantity):
                parts.append(f"{name} {self.stock_floor(name.lower()).describe()}")
        return f"stock floor on {self.backend}: " + "; ".join(parts)


def model_device(backend: Any) -> torch.device:
    """Where the backend's model lives (the CPU for a backend without a torch model)."""
    parameters = getattr(getattr(backend, "model", None), "parameters", None)
    param = next(iter(parameters()), None) if callable(parameters) else None
    return torch.device("cpu") if param is None else param.device


@torch.no_grad()
def stock_prefill_floor(backend: Any, seed: int = 0, rows: int = 4, length: int = 6) -> StockPrefillFloor:
    """Measure the batch-shape floor with the backend's stock prefill only (no harness seam runs), on the
    model's own device. Pass the fast path's row count and width as ``rows`` and ``length``: a control at
    another shape measures another GEMM's rounding."""
    if rows < 1 or length < 1:
        raise ValueError(f"a prefill floor needs rows >= 1 and length >= 1, got {rows} x {length}")
    gen = torch.Generator().manual_seed(seed)
    low = 1 if backend.pad_id == 0 else 0
    ids = torch.randint(low, backend.vocab_size, (rows, length), generator=gen)
    ids[ids == backend.pad_id] = (backend.pad_id + 1) % backend.vocab_size
    ids = ids.to(model_device(backend))
    batched_logits, batched_kv = backend.stock_prefill(ids)
    alone = [backend.stock_prefill(ids[i: i + 1]) for i in range(rows)]
    alone_logits = torch.cat([a[0] for a in alone])
    alone_kv = torch.cat([a[1] for a in alone])
    batched_logp = torch.log_softmax(batched_logits.double(), -1)
    logp = max_abs_diff(torch.log_softmax(batched_logits, -1), torch.log_softmax(alone_logits, -1))
    model = getattr(backend, "model", None)
    terms = (module_reduction_terms(model, sequence=length) + backend.vocab_size
             if isinstance(model, torch.nn.Module) else 0)
    return StockPrefillFloor(logp=logp, kv=max_abs_diff(batched_kv, alone_kv), backend=backend.name,
                             logp_scale=float(batched_logp.abs().max()), kv_scale=float(batched_kv.abs().max()),
                             rows=rows, length=length, terms=terms)


def fp32_tolerance(floor: StockPrefillFloor, quantity: str, k: float = TOLERANCE_K) -> float:
    """``k`` x the stock floor of ``quantity``; a ValueError when the stock run was not finite."""
    value = floor.floor(quantity)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the stock floor of {quantity} on {floor.backend} is {value!r}: the stock run must be "
                         "finite to derive an fp32 tolerance from it")
    return k * value


@dataclass(frozen=True)
class ARPolicies:
    tokens: Policy
    logp: Policy
    kv: Policy
    slot0: Policy
    floor: StockPrefillFloor | None = None


def fp32_policies(floor: StockPrefillFloor, k: float = TOLERANCE_K) -> ARPolicies:
    """Tokens exact; log-probs and KV ``close`` at ``k`` x the stock floor measured on the same model."""
    logp_atol, kv_atol = fp32_tolerance(floor, "logp", k), fp32_tolerance(floor, "kv", k)
    logp = close(atol=logp_atol, rtol=0.0, reason=f"fp32 batch-shape rounding, {k:g} x {floor.describe('logp')}")
    kv = close(atol=kv_atol, rtol=0.0, reason=f"fp32 batch-shape rounding, {k:g} x {floor.describe('kv')}")
    slot0 = close(atol=kv_atol, rtol=0.0, reason=(
        "slot 0 is position 0 attending only itself, bitwise where B=1 and batched GEMMs share kernels "
        f"(the AR PR measured 0.0); small-M CPU GEMMs (short B=1 prompts, small expert groups) differ; {k:g} x "
        f"{floor.describe('kv')}"))
    return ARPolicies(exact(), logp, kv, slot0, floor)


def exact_policies() -> ARPolicies:
    """B=1 through upstream's own dynamic path runs the very forwards the stock loop runs: bitwise."""
    return ARPolicies(exact(), exact(), exact(), exact(), None)
