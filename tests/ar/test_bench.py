"""Batched AR against B separate B=1 runs and against the model's own limit, on every tiny ar model at B = 4, 8,
in both batch layouts (right-padded and left-padded).

Four arms per model, layout and B, timed interleaved (each round runs every arm once) and kept at their best round:

- ``fast``: ``loop.fast_rollout`` of the right-padded batch, or ``left_padded.fast_left_rollout`` of the
  left-padded one (16 new tokens per row, greedy, no EOS);
- ``stock``: ``loop.stock_rollout``, each prompt alone at B=1;
- ``raw``: the model's own forwards the fast path made (its prefill and decode steps, with the masks, positions
  and ids it handed the model, over a fresh static cache of the batch's length), replayed back to back: no
  sampling, mask building, cache bookkeeping or log-prob recording;
- ``raw_stock``: the same for the B=1 runs (each over a fresh cache of the kind the stock run uses).

fast/raw is what the harness costs over the model's own calls; ideal 1/B. A fast rollout's KV in logical order is
gathered when a check first reads it (``loop.LogicalKV``), so no arm here pays for it; each stock run stacks its
own. The rows land in the run's benchmark
table (``pytest -m bench -k ar``, or ``-k qwen3``) and the report's ``benchmarks``. No timed assertion: the two
rollouts must agree and the replay must reproduce the fast path's logits before any time means anything.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import ARCase
from fixtures.bench_timing import bench_rounds, best_of, interleaved
from harness.ar import left_padded, loop

pytestmark = pytest.mark.bench

BATCHES = (4, 8)
LENGTHS = (24, 31, 17, 28, 22, 30, 19, 26)  # unequal real_pos, cycled to the batch
DECODE_STEPS = 15
ROUNDS = bench_rounds(10)
TITLE = (f"ar: the batched rollout (B right- or left-padded rows) vs B stock B=1 runs, {DECODE_STEPS + 1} new "
         f"tokens per row, fp32 CPU, best of {ROUNDS} interleaved rounds; raw = the model's own forwards of the fast "
         "path replayed back to back (raw stock: of the B=1 runs); ideal 1/B")


@dataclass(frozen=True)
class Forward:
    """One model call as the harness made it: positional and keyword arguments (tensors copied) and its logits."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    logits: torch.Tensor


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _recording(model: torch.nn.Module) -> Iterator[list[Forward]]:
    """Every forward of ``model`` while the block runs (arguments copied before the call, logits after)."""
    calls: list[Forward] = []
    pending: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def before(module: Any, args: tuple, kwargs: dict) -> None:
        pending.append((tuple(_copied(a) for a in args), {k: _copied(v) for k, v in kwargs.items()}))

    def after(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        recorded_args, recorded_kwargs = pending.pop()
        calls.append(Forward(recorded_args, recorded_kwargs, getattr(output, "logits", output).clone()))

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _cache_of(kwargs: dict[str, Any]) -> Any:
    return kwargs.get("past_key_values", kwargs.get("cache"))


def replay(model: torch.nn.Module, calls: list[Forward], fresh: list[Callable[[], Any]]) -> list[torch.Tensor]:
    """The recorded forwards back to back, the i-th distinct cache they wrote replaced by ``fresh[i]()``: the
    model's own work, nothing of the harness around it. Returns each call's logits."""
    caches: dict[int, Any] = {}
    out = []
    with torch.no_grad():
        for call in calls:
            recorded = _cache_of(call.kwargs)
            if id(recorded) not in caches:
                caches[id(recorded)] = fresh[len(caches)]()
            kwargs = {k: caches[id(recorded)] if v is recorded and v is not None else v for k, v in call.kwargs.items()}
            out.append(getattr(model(*call.args, **kwargs), "logits", None))
    return out


def _case(batch_size: int) -> ARCase:
    return ARCase(f"bench_b{batch_size}", tuple(LENGTHS[i % len(LENGTHS)] for i in range(batch_size)),
                  decode_steps=DECODE_STEPS, seed=41)


@pytest.fixture(params=ar_models.BACKENDS)
def model(request: pytest.FixtureRequest) -> str:
    """A parametrized fixture, not a parametrize mark: the mark's keyword "parametrize" would match ``-k ar`` in
    every path's bench, and ``-k`` must pick one path's (or one model's) table."""
    return request.param


@pytest.fixture(params=BATCHES, ids=[f"b{b}" for b in BATCHES])
def batch_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(params=("right", "left"))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


def test_ar_fast_vs_stock_vs_raw(benchmark: Any, bench_log: Any, model: str, layout: str, batch_size: int) -> None:
    backend = ar_models.backend(model)
    case = _case(batch_size)
    prompts, new_tokens = case.prompts(), case.max_new_tokens
    if layout == "left":
        batch: Any = left_padded.left_padded_batch(prompts, backend.pad_id)
        rollout, cache_owner = left_padded.fast_left_rollout, left_padded.layout_for(backend)
    else:
        batch, rollout, cache_owner = case.batch(), loop.fast_rollout, backend
    with _recording(backend.model) as fast_calls:
        fast = rollout(backend, batch, new_tokens)
    with _recording(backend.model) as stock_calls:
        stock = loop.stock_rollout(backend, prompts, new_tokens)
    assert torch.equal(fast.tokens, stock.tokens), "batched and B=1 rollouts must agree before timing means anything"
    fresh_fast = [lambda: cache_owner.new_cache(batch_size, batch.width + new_tokens, dynamic=False)]
    fresh_stock = [functools.partial(backend.new_cache, 1, int(p.numel()) + new_tokens, dynamic=True)
                   for p in prompts]
    replayed = replay(backend.model, fast_calls, fresh_fast)
    assert all(torch.equal(r, c.logits) for r, c in zip(replayed, fast_calls, strict=True)), \
        "the raw replay must compute what the fast path's forwards computed"
    assert len({id(_cache_of(c.kwargs)) for c in stock_calls}) == len(prompts), "one cache per B=1 run"

    times = best_of(interleaved({
        "fast": lambda: rollout(backend, batch, new_tokens),
        "stock": lambda: loop.stock_rollout(backend, prompts, new_tokens),
        "raw": lambda: replay(backend.model, fast_calls, fresh_fast),
        "raw_stock": lambda: replay(backend.model, stock_calls, fresh_stock),
    }, ROUNDS, benchmark))
    row = bench_log.record("ar", TITLE, {"model": model, "layout": layout, "B": batch_size}, ideal=1 / batch_size,
                           extra={"tokens": int(fast.lengths.sum()), "forwards": len(fast_calls)}, **times)
    benchmark.extra_info.update({f"{arm}_s": seconds for arm, seconds in times.items()},
                                **{k: v for k, v in row.ratios().items() if v is not None})
