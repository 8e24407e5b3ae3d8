"""Probed batched rollouts: any rollout function, measured through hooks on the model's forwards.

- ``nan_probe_rollout`` plants NaN in every cache slot before the first forward, and after the prefill in every
  slot a row may no longer read (its pads, the never-written tail). With a mask that admits exactly the valid
  keys and a kernel that skips masked slots, every logit stays finite; one admitted dead slot turns a row to NaN.
- ``footprint_rollout`` snapshots the cache after the prefill and reports, per row, every slot written after
  the prefill that is not one of the row's own generated tokens: a finished row must stop writing KV.

Both read the batch's slot layout from ``backend.logical_slots`` (for a left-padded batch, the backend's
``harness.ar.left_padded`` layout) and the spy reads the prefill rows' padding (given the backend's pad id).

The rollout under test is a black box ``rollout(backend, batch, max_new_tokens, eos)`` (the suite's
``fast_rollout`` or a user's under ``--impl ar=...``): the probes only see the cache its forwards are given
(``past_key_values``), before the first forward and after it, so nothing inside the rollout changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.ar import cache as ar_cache
from harness.ar.batch import ARBatch
from harness.ar.loop import Rollout, fast_rollout, real_positions
from harness.ar.spy import ARForwardSpy

__all__ = ["ProbedRun", "capacity", "dead_slots", "footprint_rollout", "nan_probe_rollout"]

RolloutFn = Callable[..., Rollout]


@dataclass
class ProbedRun:
    rollout: Rollout
    spy: ARForwardSpy
    static: bool
    poisoned_slots: int = 0
    nonfinite_logits: int = 0
    stray_writes: dict[int, list[int]] = field(default_factory=dict)  # row -> slots written while not allowed


def dead_slots(backend: Any, batch: ARBatch, max_cache_len: int) -> torch.Tensor:
    """``[B, max_cache_len]`` True where a slot is not one of the row's valid keys right after the prefill."""
    real_pos = real_positions(batch)
    dead = torch.ones(batch.batch_size, max_cache_len, dtype=torch.bool)
    for i in range(batch.batch_size):
        dead[i, backend.logical_slots(int(real_pos[i]), batch.width, 0)] = False
    return dead


def _cache_of(kwargs: dict[str, Any]) -> Any:
    return kwargs.get("past_key_values", kwargs.get("cache"))


@contextlib.contextmanager
def _around_prefill(model: Any, before: Callable[[Any], None], after: Callable[[Any], None]) -> Iterator[list[Any]]:
    """Call ``before(cache)`` ahead of the model's first forward and ``after(cache)`` once it returned; yields
    the list the first forward's cache is put in (empty when no forward ran)."""
    seen: list[Any] = []

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append(_cache_of(kwargs))
            before(seen[0])

    def post(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if len(seen) == 1:
            seen.append("prefill done")
            after(seen[0])

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _static(cache: Any) -> bool:
    return cache is not None and not ar_cache.is_dynamic(cache)


def capacity(cache: Any, batch: ARBatch, max_new_tokens: int) -> int:
    """The slots the rollout's cache holds per row: any number from the batch's width plus its new tokens up (a
    cache allocated in whole blocks, or once at a maximum length, holds more); fewer is a ValueError naming both."""
    slots = int(ar_cache.layer_buffers(cache)[0][0].shape[2])
    needed = batch.width + max_new_tokens
    if slots < needed:
        raise ValueError(f"the rollout's {type(cache).__name__} holds {slots} slots per row; a batch of width "
                         f"{batch.width} with {max_new_tokens} new tokens needs at least {needed}")
    return slots


def nan_probe_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = (),
                      rollout: RolloutFn = fast_rollout) -> ProbedRun:
    """Run ``rollout`` with NaN in every unused and dead slot, whatever the cache's capacity; count non-finite logits
    of emitting rows."""
    poisoned = [0]

    def before(cache: Any) -> None:
        if _static(cache):
            ar_cache.preallocate(cache, batch.batch_size, backend.kv_heads, backend.head_dim, backend.model.dtype,
                                 batch.input_ids.device, float("nan"))

    def after(cache: Any) -> None:
        if _static(cache):
            slots = capacity(cache, batch, max_new_tokens)
            poisoned[0] = ar_cache.fill_slots(cache, dead_slots(backend, batch, slots), float("nan"))

    spy = ARForwardSpy(backend.model, pad_id=getattr(backend, "pad_id", None))
    with spy, _around_prefill(backend.model, before, after) as seen:
        result = rollout(backend, batch, max_new_tokens, eos)
    emitted = torch.arange(result.tokens.shape[1])[None] < result.lengths[:, None]
    bad = int((~torch.isfinite(result.logits[emitted])).sum())
    static = bool(seen) and _static(seen[0])
    return ProbedRun(result, spy, static, poisoned_slots=poisoned[0], nonfinite_logits=bad)


def footprint_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = (),
                      rollout: RolloutFn = fast_rollout) -> ProbedRun:
    """Run ``rollout`` and find every slot a row wrote after the prefill outside its generated tokens."""
    after_prefill: list[tuple[torch.Tensor, torch.Tensor]] = []

    def after(cache: Any) -> None:
        if _static(cache):
            after_prefill.extend((k.clone(), v.clone()) for k, v in ar_cache.layer_buffers(cache))

    spy = ARForwardSpy(backend.model, pad_id=getattr(backend, "pad_id", None))
    with spy, _around_prefill(backend.model, lambda cache: None, after) as seen:
        result = rollout(backend, batch, max_new_tokens, eos)
    static = bool(seen) and _static(seen[0])
    stray: dict[int, list[int]] = {}
    if after_prefill:  # filled only when the first forward was handed a static cache: static is True here
        real_pos = real_positions(batch)
        final = ar_cache.layer_buffers(seen[0])
        slots = final[0][0].shape[2]
        changed = torch.zeros(batch.batch_size, slots, dtype=torch.bool)
        for (k0, v0), (k1, v1) in zip(after_prefill, final, strict=True):
            for before, now in ((k0, k1), (v0, v1)):
                same = (before == now) | (torch.isnan(before) & torch.isnan(now))
                changed |= ~same.all(dim=-1).all(dim=1).cpu()
        for i in range(batch.batch_size):
            rp, fed = int(real_pos[i]), max(int(result.lengths[i]) - 1, 0)  # the last token is never fed
            allowed = torch.zeros(slots, dtype=torch.bool)
            allowed[backend.logical_slots(rp, batch.width, fed)[rp:]] = True
            extra = (changed[i] & ~allowed).nonzero().squeeze(-1).tolist()
            if extra:
                stray[i] = extra
    return ProbedRun(result, spy, static, stray_writes=stray)
