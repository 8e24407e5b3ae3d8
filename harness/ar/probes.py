"""Probed batched rollouts: the batched loop driven step by step with a measurement between steps.

- ``nan_probe_rollout`` plants NaN in every cache slot before the run, and after the prefill in every slot a
  row may no longer read (its pads, the never-written tail). With a mask that admits exactly the valid keys and a
  kernel that skips masked slots, every logit stays finite; one admitted dead slot turns a row to NaN.
- ``footprint_rollout`` snapshots the cache after the prefill and reports, per row, every slot written after
  the prefill that is not one of the row's own generated tokens: a finished row must stop writing KV.

Nothing inside the loop changes: the probes only read and write the cache between ``step`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.ar import cache as ar_cache
from harness.ar.batch import ARBatch
from harness.ar.loop import ARState, Rollout, collect, init_state, step
from harness.ar.spy import ARForwardSpy

__all__ = ["ProbedRun", "dead_slots", "footprint_rollout", "nan_probe_rollout"]


@dataclass
class ProbedRun:
    rollout: Rollout
    spy: ARForwardSpy
    static: bool
    poisoned_slots: int = 0
    nonfinite_logits: int = 0
    stray_writes: dict[int, list[int]] = field(default_factory=dict)  # row -> slots written while not allowed


def dead_slots(state: ARState) -> torch.Tensor:
    """``[B, max_cache_len]`` True where a slot is not one of the row's valid keys (after the prefill)."""
    bsz = state.batch.batch_size
    dead = torch.ones(bsz, state.max_cache_len, dtype=torch.bool)
    for i in range(bsz):
        live = state.backend.logical_slots(int(state.real_pos[i]), state.batch.width, int(state.generated[i]))
        dead[i, live] = False
    return dead


def nan_probe_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = ()) -> ProbedRun:
    """Run the batched loop with NaN in every unused and dead slot; count non-finite logits of emitting rows."""
    with ARForwardSpy(backend.model) as spy:
        state = init_state(backend, batch, max_new_tokens, eos)
        static = not ar_cache.is_dynamic(state.cache)
        if static:
            ar_cache.preallocate(state.cache, batch.batch_size, backend.kv_heads, backend.head_dim,
                                 backend.model.dtype, batch.input_ids.device, float("nan"))
        step(state)
        poisoned = ar_cache.fill_slots(state.cache, dead_slots(state), float("nan")) if static else 0
        while not state.done:
            step(state)
    rollout = collect(state)
    emitted = torch.arange(max_new_tokens)[None] < rollout.lengths[:, None]
    bad = int((~torch.isfinite(rollout.logits[emitted])).sum())
    return ProbedRun(rollout, spy, static, poisoned_slots=poisoned, nonfinite_logits=bad)


def footprint_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = ()) -> ProbedRun:
    """Run the batched loop and find every slot a row wrote after the prefill outside its generated tokens."""
    with ARForwardSpy(backend.model) as spy:
        state = init_state(backend, batch, max_new_tokens, eos)
        step(state)
        static = not ar_cache.is_dynamic(state.cache)
        after_prefill = [(k.clone(), v.clone()) for k, v in ar_cache.layer_buffers(state.cache)] if static else []
        while not state.done:
            step(state)
    stray: dict[int, list[int]] = {}
    rollout = collect(state)
    if static:
        changed = torch.zeros(batch.batch_size, state.max_cache_len, dtype=torch.bool)
        for (k0, v0), (k1, v1) in zip(after_prefill, ar_cache.layer_buffers(state.cache), strict=True):
            for before, after in ((k0, k1), (v0, v1)):
                same = (before == after) | (torch.isnan(before) & torch.isnan(after))
                changed |= ~same.all(dim=-1).all(dim=1).cpu()
        for i in range(batch.batch_size):
            rp, fed = int(state.real_pos[i]), int(rollout.lengths[i]) - 1  # the last token is never fed
            own = backend.logical_slots(rp, batch.width, fed)[rp:]
            allowed = torch.zeros(state.max_cache_len, dtype=torch.bool)
            allowed[own] = True
            extra = (changed[i] & ~allowed).nonzero().squeeze(-1).tolist()
            if extra:
                stray[i] = extra
    return ProbedRun(rollout, spy, static, stray_writes=stray)
