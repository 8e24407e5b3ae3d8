"""What a rollout does with its KV cache, named: upstream's dynamic cache handed several rows (it crashes on a bare
assertion), and a cache of another capacity than the probes assumed (any from width plus new tokens up is right)."""

from __future__ import annotations

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import CASES
from harness.ar import cache as ar_cache
from harness.ar import comparisons, judge

pytestmark = pytest.mark.cpu


def _write(rows: int, dynamic: bool) -> BaseException | None:
    """One write of ``rows`` rows into the fake upstream's own cache class."""
    backend = ar_models.backend("fake")
    cache = backend.new_cache(rows, 8, dynamic)
    keys = torch.zeros(rows, backend.kv_heads, 2, backend.head_dim)
    positions = torch.arange(2).repeat(rows, 1)
    try:
        cache.update(keys, keys, 0, {"cache_position": positions})
    except Exception as err:  # noqa: BLE001 - what it raised is the measurement
        return err
    return None


def test_the_dynamic_cache_at_several_rows_is_named_and_nothing_else_is():
    err = _write(3, dynamic=True)
    assert isinstance(err, AssertionError) and str(err) == ""  # upstream's assertion says nothing
    assert judge.dynamic_cache_batch(err).startswith("a dynamic cache at B = 3: HunyuanStaticCache(dynamic=True)")
    assert _write(1, dynamic=True) is None and _write(3, dynamic=False) is None
    assert judge.dynamic_cache_batch(ValueError("another failure")) == ""


def test_a_rollout_that_keeps_the_dynamic_cache_at_b4_fails_naming_it(monkeypatch):
    monkeypatch.setattr(ar_cache, "cache_is_dynamic", lambda batch_size: True)
    case = next(c for c in CASES if c.batch_size > 1)
    with pytest.raises(comparisons.DynamicCacheAtBatch, match=f"a dynamic cache at B = {case.batch_size}") as raised:
        comparisons.compare_batched("tokens", ar_models.backend("fake"), case.batch(), case.max_new_tokens, None, None)
    assert isinstance(raised.value, AssertionError)  # still upstream's assertion, for whoever catches that
    assert isinstance(raised.value.__cause__, AssertionError)


def test_the_probes_read_any_capacity_from_width_plus_new_tokens_up_and_name_a_smaller_one():
    from types import SimpleNamespace

    from harness.ar import probes

    case = next(c for c in CASES if c.batch_size > 1)
    batch, needed = case.batch(), case.batch().width + case.max_new_tokens

    def cache(slots: int) -> SimpleNamespace:
        keys = torch.zeros(batch.batch_size, 2, slots, 4)
        return SimpleNamespace(layers=[SimpleNamespace(keys=keys, values=keys.clone())])

    assert probes.capacity(cache(needed), batch, case.max_new_tokens) == needed
    assert probes.capacity(cache(64 * -(-needed // 64)), batch, case.max_new_tokens) == 64 * -(-needed // 64)
    with pytest.raises(ValueError, match=f"holds {needed - 1} slots per row; a batch of width {batch.width} with "
                                         f"{case.max_new_tokens} new tokens needs at least {needed}"):
        probes.capacity(cache(needed - 1), batch, case.max_new_tokens)
