"""Benchmark: batched B=4 AR over a static cache vs four B=1 runs on the tiny HunYuanMoEV1 (no timed asserts).

Prints tokens/s of both and the batched/serial time ratio next to the ideal 1/4 (a batch of 4 costing one
B=1 run). On tiny CPU models, per-op overhead dominates, so the ratio is an upper bound on what batching buys.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import ARCase
from harness.ar import loop

pytestmark = pytest.mark.bench

CASE = ARCase("bench", (24, 31, 17, 28), decode_steps=15, seed=41)
ROUNDS = 5


def test_ar_batched_b4_vs_four_b1(benchmark) -> None:
    backend = ar_models.backend("hunyuan_moe")
    batch, prompts, new_tokens = CASE.batch(), CASE.prompts(), CASE.max_new_tokens

    fast = benchmark.pedantic(loop.fast_rollout, args=(backend, batch, new_tokens), rounds=ROUNDS, iterations=1,
                              warmup_rounds=1)
    serial_times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        serial = loop.stock_rollout(backend, prompts, new_tokens)
        serial_times.append(time.perf_counter() - start)
    assert torch.equal(fast.tokens, serial.tokens), "batched and B=1 rollouts must agree before timing means anything"

    tokens = int(fast.lengths.sum())
    batched_s = benchmark.stats.stats.median
    serial_s = statistics.median(serial_times)
    ratio = batched_s / serial_s
    benchmark.extra_info.update(tokens=tokens, batched_tokens_per_s=tokens / batched_s,
                                serial_tokens_per_s=tokens / serial_s, ratio=ratio, ideal_ratio=0.25)
    print(f"\nar bench: B=4, {new_tokens} new tokens per row, {tokens} tokens, tiny HunYuanMoEV1 (fp32 CPU)")
    print(f"  batched B=4 : {batched_s * 1e3:8.1f} ms  {tokens / batched_s:8.0f} tokens/s")
    print(f"  4 x B=1     : {serial_s * 1e3:8.1f} ms  {tokens / serial_s:8.0f} tokens/s")
    print(f"  time ratio batched / serial = {ratio:.3f} (ideal 1/4 = 0.250; speed-up x{1 / ratio:.2f} of ideal x4)")
