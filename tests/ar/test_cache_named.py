"""What a rollout does with its KV cache, named: upstream's dynamic cache handed several rows (it crashes on a bare
assertion), and a cache of another capacity than the probes assumed (any from width plus new tokens up is right)."""

from __future__ import annotations

from types import SimpleNamespace

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


class _Unflagged:
    """A cache class that never says whether it is dynamic."""

    def update(self, key_states: torch.Tensor) -> None:
        raise AssertionError


class _Flagged(_Unflagged):
    dynamic = True


def _raised_in_update(cache: _Unflagged, shape: tuple[int, ...]) -> BaseException:
    try:
        cache.update(torch.zeros(shape))
    except AssertionError as err:
        return err
    raise AssertionError("update did not raise")


def test_the_spy_reads_slots_off_a_static_cache_only():
    from harness.ar import spy as ar_spy

    backend = ar_models.backend("fake")
    for dynamic, slots in ((False, 8), (True, None)):
        cache = backend.new_cache(1, 8, dynamic)
        keys = torch.zeros(1, backend.kv_heads, 2, backend.head_dim)
        for layer in range(len(cache.layers)):  # the first forward allocates every layer's buffers
            cache.update(keys, keys, layer, {"cache_position": torch.arange(2)[None]})
        assert ar_spy.cache_slots(cache) == slots, dynamic
    assert ar_spy.cache_slots(None) is None
    one_layer = SimpleNamespace(dynamic=False, layers=[SimpleNamespace(keys=torch.zeros(2, 1, 5, 4),
                                                                       values=torch.zeros(2, 1, 5, 4))])
    assert ar_spy.cache_slots(one_layer) == 5  # a model of one layer: its only layer's slots


def test_only_a_cache_flagged_dynamic_and_handed_several_rows_is_named():
    assert judge.dynamic_cache_batch(_raised_in_update(_Flagged(), (2, 1, 2, 4))).startswith(
        "a dynamic cache at B = 2: _Flagged(dynamic=True)")
    assert judge.dynamic_cache_batch(_raised_in_update(_Flagged(), (1, 3, 2, 4))) == ""  # one row, three heads
    assert judge.dynamic_cache_batch(_raised_in_update(_Unflagged(), (3, 1, 2, 4))) == ""  # not flagged dynamic


def test_a_rollout_that_keeps_the_dynamic_cache_at_b4_fails_naming_it(monkeypatch):
    monkeypatch.setattr(ar_cache, "cache_is_dynamic", lambda batch_size: True)
    case = next(c for c in CASES if c.batch_size > 1)
    with pytest.raises(comparisons.DynamicCacheAtBatch, match=f"a dynamic cache at B = {case.batch_size}") as raised:
        comparisons.compare_batched("tokens", ar_models.backend("fake"), case.batch(), case.max_new_tokens, None, None)
    assert isinstance(raised.value, AssertionError)  # still upstream's assertion, for whoever catches that
    assert isinstance(raised.value.__cause__, AssertionError)


def test_the_probes_read_any_capacity_from_width_plus_new_tokens_up_and_name_a_smaller_one():
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
