"""The batched loop's bookkeeping, the cache helpers, the probes and the suite's facts, on tiny inputs.

bf16 runs show what the fp32 parity runs cannot: every recorded quantity leaves the loop in fp32, computed
from fp32 logits. Small wrapper backends make one thing go wrong on purpose (a finished row's logits turn
NaN, a stray NaN write, a probe that plants nothing) to show the probes and facts see it.
"""

from __future__ import annotations

import contextlib
import signal
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import eos_for_one_stop, eos_for_stops, prompt_ids
from harness.ar import cache as ar_cache
from harness.ar import comparisons, loop, probes
from harness.ar import policies as ar_policies
from harness.ar.backends import StockRun
from harness.ar.batch import concat, embed_row, right_padded_batch
from harness.ar.spy import ARForwardSpy
from harness.judging.compare import close

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID
V = ar_models.VOCAB


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging: a loop that never advances must not stall the tier."""
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Wrapped:
    """A backend that delegates everything to ``inner`` (subclasses override one hook)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --------------------------------------------------------------------------------------------- batch and loop


def test_embed_row_names_the_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        embed_row([])


def test_concat_refuses_a_row_that_is_not_one_embedded_prompt() -> None:
    one = embed_row([5, 6, 7])
    two_rows = type(one)(one.input_ids.expand(2, -1), one.position_ids, one.attention_mask, one.real_pos)
    with pytest.raises(ValueError, match=r"row 1: input_ids must be \[1, L\], got \(2, 3\)"):
        concat([one, two_rows], PAD)


def test_real_positions_are_long_and_the_state_owns_its_token_buffer() -> None:
    batch = right_padded_batch(prompt_ids((3, 5), seed=51), PAD)
    batch = type(batch)(batch.input_ids, batch.position_ids, batch.attention_mask,
                        batch.real_pos.to(torch.int32), PAD)
    real_pos = loop.real_positions(batch)
    assert real_pos.dtype == torch.long and real_pos.tolist() == [3, 5]
    state = loop.init_state(ar_models.backend("fake"), batch, 2)
    assert torch.equal(state.input_ids, batch.input_ids)
    assert state.input_ids.data_ptr() != batch.input_ids.data_ptr()  # writing the buffer never edits the batch


def test_rollout_prefill_kv_is_the_prompt_slots() -> None:
    kv = torch.arange(2 * 3 * 2 * 1 * 6 * 1, dtype=torch.float32).reshape(2, 3, 2, 1, 6, 1)
    rollout = loop.Rollout(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2, 3), torch.tensor([2, 2]),
                           torch.tensor([4, 2]), (kv[0], kv[1]))
    assert torch.equal(rollout.prefill_kv(0), kv[0][..., :4, :])
    assert torch.equal(rollout.prefill_kv(1), kv[1][..., :2, :])


class Bf16StockRun(Wrapped):
    """A backend whose stock run hands back bf16 logits and KV (what a bf16 model's own output is)."""

    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        run = self.inner.stock_generate(prompt, max_new_tokens, eos)
        return StockRun(run.tokens, run.logits.bfloat16(), run.kv.bfloat16())


def test_stock_rollout_records_fp32_whatever_the_stock_run_returns() -> None:
    prompts = prompt_ids((4, 7), seed=53)
    stock = loop.stock_rollout(Bf16StockRun(ar_models.backend("fake")), prompts, 3)
    assert all(kv.dtype == torch.float32 for kv in stock.kv)
    want = torch.log_softmax(stock.logits.double(), dim=-1).gather(-1, stock.tokens[..., None])[..., 0]
    torch.testing.assert_close(stock.logp, want.float(), rtol=0.0, atol=2e-6)


def test_fast_rollout_finishes_in_max_new_tokens_forwards() -> None:
    backend = ar_models.backend("fake")
    with deadline(8.0), ARForwardSpy(backend.model) as spy:
        fast = loop.fast_rollout(backend, right_padded_batch(prompt_ids((4, 6), seed=54), PAD), 3)
    assert spy.batch_sizes == [2, 2, 2] and fast.lengths.tolist() == [3, 3]


class OnDevice(torch.Tensor):
    """Stands for a tensor on an accelerator on a CPU-only machine: every op keeps the type, only ``.cpu()``
    hands back a plain (host) tensor. A result still of this type never came back to the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu:
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def _host(rollout: loop.Rollout) -> bool:
    fields = (rollout.tokens, rollout.logp, rollout.logits, rollout.lengths, rollout.real_pos, *rollout.kv)
    return all(type(t) is torch.Tensor for t in fields)


def test_collect_brings_every_field_of_a_device_state_to_the_host() -> None:
    backend = ar_models.backend("fake")
    state = loop.init_state(backend, right_padded_batch(prompt_ids((4, 6), seed=62), PAD), 2)
    while not state.done:
        loop.step(state)
    expected = loop.collect(state)
    for name in ("tokens", "logp", "logits", "lengths", "real_pos", "generated"):
        setattr(state, name, getattr(state, name).as_subclass(OnDevice))
    for layer in state.cache.layers:
        layer.keys, layer.values = layer.keys.as_subclass(OnDevice), layer.values.as_subclass(OnDevice)
    rollout = loop.collect(state)
    assert _host(rollout)
    assert torch.equal(rollout.logits, expected.logits) and torch.equal(rollout.kv[1], expected.kv[1])


class DeviceStockRun(Wrapped):
    """A backend whose stock run is left on the accelerator."""

    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        run = self.inner.stock_generate(prompt, max_new_tokens, eos)
        return StockRun(*(t.as_subclass(OnDevice) for t in (run.tokens, run.logits, run.kv)))


def test_stock_rollout_brings_a_device_stock_run_to_the_host() -> None:
    backend = ar_models.backend("fake")
    prompts = prompt_ids((4, 6), seed=63)
    assert _host(loop.stock_rollout(DeviceStockRun(backend), prompts, 2))


# --------------------------------------------------------------------------------------------- cache helpers


def test_layer_buffers_refuse_a_layer_without_keys() -> None:
    key = torch.zeros(1)
    without_keys = SimpleNamespace(layers=[SimpleNamespace(keys=key, values=key), SimpleNamespace(keys=None)])
    with pytest.raises(ValueError, match="cache layer 1 holds no KV yet"):
        ar_cache.layer_buffers(without_keys)
    with pytest.raises(ValueError, match="cache layer 0 holds no KV yet"):
        ar_cache.layer_buffers(SimpleNamespace(layers=[SimpleNamespace(keys=key, values=key, is_initialized=False)]))


def test_preallocate_and_fill_slots_write_keys_and_values() -> None:
    backend = ar_models.backend("fake")
    cache = backend.new_cache(2, 5, dynamic=False)
    ar_cache.preallocate(cache, 2, backend.kv_heads, backend.head_dim, torch.float32, torch.device("cpu"), 3.0)
    slots = torch.tensor([[True, False, False, False, True], [False, False, True, False, False]])
    assert ar_cache.fill_slots(cache, slots, -1.0) == 3
    for k, v in ar_cache.layer_buffers(cache):
        for buf in (k, v):
            assert buf.shape == (2, backend.kv_heads, 5, backend.head_dim)
            want = torch.where(slots[:, None, :, None], -1.0, 3.0).expand_as(buf)
            assert torch.equal(buf, want)


# --------------------------------------------------------------------------------------------- probes and spy


class FinishedRowsGoNaN(Wrapped):
    """Rows that already finished compute NaN logits: harmless, since nothing of theirs is kept."""

    def decode(self, state: loop.ARState, mask: torch.Tensor | None) -> torch.Tensor:
        logits = self.inner.decode(state, mask)
        logits[state.finished.to(logits.device)] = float("nan")
        return logits


def _early_stop(backend: Any, lengths: tuple[int, ...], seed: int, stops: dict[int, int], steps: int):
    prompts = prompt_ids(lengths, seed=seed)
    full = loop.stock_rollout(backend, prompts, steps)
    eos, ends = eos_for_stops(full.tokens, stops)
    return right_padded_batch(prompts, PAD), eos, ends


def test_nan_probe_counts_only_emitted_logits() -> None:
    backend = ar_models.backend("fake", "read_safe")
    batch, eos, ends = _early_stop(backend, (5, 8), 55, {0: 1}, 4)
    assert ends == [2, 4], "fixture: row 0 stops at step 1, row 1 runs on"
    with deadline(8.0):
        run = probes.nan_probe_rollout(FinishedRowsGoNaN(backend), batch, 4, eos)
    assert run.rollout.lengths.tolist() == ends and bool(torch.isnan(run.rollout.logits[0, 2:]).all())
    assert run.static and run.poisoned_slots > 0 and run.nonfinite_logits == 0


def test_nan_probe_plants_nothing_in_a_dynamic_cache() -> None:
    backend = ar_models.backend("fake", "read_safe")
    hooks = len(backend.model._forward_pre_hooks), len(backend.model._forward_hooks)
    with deadline(8.0):
        run = probes.nan_probe_rollout(backend, right_padded_batch(prompt_ids((5,), seed=56), PAD), 2)
    assert (run.static, run.poisoned_slots, run.nonfinite_logits) == (False, 0, 0)
    assert (len(backend.model._forward_pre_hooks), len(backend.model._forward_hooks)) == hooks, "the probe's hooks stay"


def test_padded_b1_is_asked_only_of_one_row_that_holds_pads() -> None:
    """Two rows, or one row without pads (its real length the batch's width), are a caller's mistake, named."""
    backend = ar_models.backend("fake")
    policies = ar_policies.fp32_policies(ar_policies.StockPrefillFloor(0.0, 0.0, "fake", 1.0, 1.0))
    reference = loop.stock_rollout(backend, prompt_ids((5,), seed=58), 2)
    for prompts in ((5, 7), (5,)):
        batch = right_padded_batch(prompt_ids(prompts, seed=58), PAD)
        with pytest.raises(ValueError, match="needs one padded row"):
            comparisons.compare_padded_b1(backend, batch, 2, policies, reference)


class StrayWrite(Wrapped):
    """After every decode step, row 0 writes ``value`` into ``slots`` of layer 0's keys or values (``buffer`` 0
    or 1), none of them its own."""

    def __init__(self, inner: Any, buffer: int, slots: list[int], value: float) -> None:
        super().__init__(inner)
        self.buffer, self.slots, self.value = buffer, slots, value

    def decode(self, state: loop.ARState, mask: torch.Tensor | None) -> torch.Tensor:
        logits = self.inner.decode(state, mask)
        ar_cache.layer_buffers(state.cache)[0][self.buffer][0, :, self.slots] = self.value
        return logits


@pytest.mark.parametrize("buffer", [0, 1], ids=["keys", "values"])
@pytest.mark.parametrize("value", [float("nan"), 0.5])
def test_footprint_sees_a_stray_write_nan_or_not(buffer: int, value: float) -> None:
    backend = ar_models.backend("fake")
    batch = right_padded_batch(prompt_ids((4, 6), seed=57), PAD)
    with deadline(8.0):
        run = probes.footprint_rollout(StrayWrite(backend, buffer, [7, 8], value), batch, 3)
    assert run.static and run.stray_writes == {0: [7, 8]}  # row 0 owns slots 4, 5 after the prefill


def test_footprint_of_a_row_that_stops_at_once_allows_it_no_slot() -> None:
    """A row whose first token (read from the prefill) is its EOS is never fed a token: after the prefill it
    owns no slot, so a write to the slot its first token would have taken is a stray write."""
    backend = ar_models.backend("fake")
    batch, eos, ends = _early_stop(backend, (5, 8), 55, {0: 0}, 3)
    assert ends == [1, 3], "fixture: row 0 stops at step 0, row 1 runs on"
    with deadline(8.0):
        run = probes.footprint_rollout(StrayWrite(backend, 0, [5], 0.5), batch, 3, eos)
    assert run.rollout.lengths.tolist() == ends
    assert run.static and run.stray_writes == {0: [5]}  # row 0's prompt is slots 0..4; slot 5 was never its


def test_footprint_of_a_clean_run_reports_no_poison_and_no_nonfinite_logits() -> None:
    """The footprint probe plants nothing and its rollout's logits are all finite: its run says so."""
    backend = ar_models.backend("fake")
    with deadline(8.0):
        run = probes.footprint_rollout(backend, right_padded_batch(prompt_ids((4, 6), seed=57), PAD), 2)
    assert bool(torch.isfinite(run.rollout.logits).all())
    assert (run.static, run.stray_writes, run.poisoned_slots, run.nonfinite_logits) == (True, {}, 0, 0)


def test_footprint_over_a_dynamic_cache_is_not_static() -> None:
    """B=1 decodes over the stock dynamic cache: no preallocated slots, so no footprint is checked."""
    backend = ar_models.backend("fake")
    with deadline(8.0):
        run = probes.footprint_rollout(backend, right_padded_batch(prompt_ids((5,), seed=56), PAD), 2)
    assert run.spy.dynamic and (run.static, run.stray_writes) == (False, {})


@pytest.mark.parametrize("probe", [probes.footprint_rollout, probes.nan_probe_rollout], ids=["footprint", "nan"])
def test_a_rollout_that_runs_no_forward_is_not_static(probe: Any) -> None:
    """A rollout that never calls the model (one replayed from a record) wrote no cache the probe could see."""
    backend = ar_models.backend("fake")
    batch = right_padded_batch(prompt_ids((4, 6), seed=57), PAD)
    recorded = loop.Rollout(torch.ones(2, 2, dtype=torch.long), torch.zeros(2, 2), torch.zeros(2, 2, V),
                            torch.tensor([2, 2]), batch.real_pos, ())
    with deadline(8.0):
        run = probe(backend, batch, 2, rollout=lambda *args: recorded)
    assert run.rollout is recorded and run.spy.calls == []
    assert (run.static, run.stray_writes, run.poisoned_slots, run.nonfinite_logits) == (False, {}, 0, 0)


class TakesACache(torch.nn.Module):
    """A model whose forward takes the ids and a cache and computes nothing: all the probes' hooks read."""

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        return input_ids


def _transformers_dynamic_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


@pytest.mark.parametrize("cache", [_transformers_dynamic_cache,
                                   lambda: ar_models.backend("fake").new_cache(1, 8, dynamic=True)],
                         ids=["transformers_dynamic", "upstream_dynamic"])
@pytest.mark.parametrize("probe", [probes.footprint_rollout, probes.nan_probe_rollout], ids=["footprint", "nan"])
def test_a_forward_handed_a_dynamic_cache_is_not_static_and_nothing_is_planted(cache: Any, probe: Any) -> None:
    """A dynamic cache has no preallocated slots, upstream's (a StaticCache subclass with dynamic=True) included:
    the probes see it handed to the forward, plant nothing, snapshot nothing and call the run not static."""
    handed = cache()
    backend = SimpleNamespace(model=TakesACache(), kv_heads=1, head_dim=2)
    batch = right_padded_batch(prompt_ids((3,), seed=59), PAD)
    recorded = loop.Rollout(torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2), torch.zeros(1, 2, V),
                            torch.tensor([2]), batch.real_pos, ())

    def rollout(backend: Any, batch: Any, max_new_tokens: int, eos: Any) -> loop.Rollout:
        backend.model(input_ids=batch.input_ids, past_key_values=handed)
        return recorded

    with deadline(2.0):
        run = probe(backend, batch, 2, rollout=rollout)
    assert run.rollout is recorded and run.spy.dynamic and len(run.spy.calls) == 1
    assert (run.static, run.stray_writes, run.poisoned_slots, run.nonfinite_logits) == (False, {}, 0, 0)


class AdmitsPads(Wrapped):
    """A decode mask that also admits each row's right-padding slots [real_pos, width)."""

    def key_valid(self, state: loop.ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        slots = torch.arange(key_length, device=generated.device)[None]
        return self.inner.key_valid(state, generated, key_length) | (slots < state.batch.width)


def test_nan_probe_catches_a_mask_that_reads_pads() -> None:
    """The pads hold NaN from right after the prefill, so a mask admitting them turns those rows' logits NaN."""
    backend = ar_models.backend("fake", "read_safe")
    batch = right_padded_batch(prompt_ids((4, 6), seed=64), PAD)
    with deadline(8.0):
        run = probes.nan_probe_rollout(AdmitsPads(backend), batch, 3)
    logits = run.rollout.logits
    assert bool(torch.isfinite(logits[1]).all()) and bool(torch.isfinite(logits[0, 0]).all())  # no pads / prefill
    assert bool(torch.isnan(logits[0, 1:]).all()) and run.nonfinite_logits == 2 * V


class PrefillReadsTheTail(Wrapped):
    """A prefill mask that admits every slot of the cache, the never-written tail included."""

    def prefill(self, state: loop.ARState, mask: torch.Tensor) -> torch.Tensor:
        return self.inner.prefill(state, torch.ones_like(mask))


def test_nan_probe_plants_nan_before_the_prefill() -> None:
    backend = ar_models.backend("fake", "read_safe")
    batch = right_padded_batch(prompt_ids((4, 6), seed=65), PAD)
    with deadline(8.0):
        run = probes.nan_probe_rollout(PrefillReadsTheTail(backend), batch, 2)
    assert run.nonfinite_logits > 0 and bool(torch.isnan(run.rollout.logits[:, 0]).all())


def test_spy_records_each_forwards_cache_class() -> None:
    backend = ar_models.backend("fake")
    prompt = prompt_ids([5], seed=58)[0]
    with torch.no_grad(), ARForwardSpy(backend.model) as spy:
        backend.full_forward(prompt)
        backend.stock_generate(prompt, 2, ())
    assert [(c.batch, c.queries, c.cache, c.dynamic) for c in spy.calls] == [
        (1, 5, "none", None), (1, 5, "HunyuanStaticCache", True), (1, 1, "HunyuanStaticCache", True)]


# --------------------------------------------------------------------------------------------- suite facts


EARLY_FACT = "a row finished while another kept generating (masking exercised)"


def test_finished_rows_needs_a_row_that_kept_generating() -> None:
    """Every row stopping at the same early step exercises no masking of a finished row: the fact fails."""
    backend = ar_models.backend("fake")
    batch, eos, ends = _early_stop(backend, (5, 8), 59, {0: 1, 1: 1}, 4)
    assert ends == [2, 2], "fixture: both rows stop at step 1"
    reference = loop.stock_rollout(backend, batch.prompts(), 4, eos)
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    verdict = comparisons.compare_finished_rows(backend, batch, 4, eos, policies, reference)
    assert verdict.violated_facts == [EARLY_FACT]


def test_oracle_errors_count_tokens_off_the_fp64_argmax() -> None:
    logits = torch.tensor([[[2.0, 0.0, 1.0, 0.5], [0.0, 3.0, 1.0, 0.5], [1.0, 1.0, 0.0, 0.5], [9.0, 9.0, 9.0, 9.0]]])
    tokens = torch.tensor([[0, 2, 0, 1]])  # step 1 is off its argmax (a tie goes to the first); 3 is past the end
    logp = torch.tensor([[-0.4, -2.2, -0.9, 0.0]])
    rollout = loop.Rollout(tokens, logp, logits, torch.tensor([3]), torch.tensor([3]), ())
    recorded, oracle, wrong = comparisons._oracle_errors(rollout, ())
    assert wrong == ["row 0 step 1 is not the fp64 argmax of its logits"]
    assert recorded.dtype == torch.float64 and oracle.dtype == torch.float64
    assert torch.equal(recorded, logp[0, :3].double())
    want = torch.log_softmax(logits[0, :3].double(), dim=-1)[[0, 1, 2], [0, 2, 0]]
    torch.testing.assert_close(oracle, want, rtol=0.0, atol=1e-15)
    assert comparisons._oracle_errors(rollout, (2,))[2] == [  # token 2 is an EOS: the row went on one step past it
        "row 0 went on 1 step(s) past its EOS at step 1", "row 0 step 1 is not the fp64 argmax of its logits"]


def test_the_oracle_fact_shows_four_wrong_steps_and_counts_the_rest() -> None:
    logits = torch.tensor([[[0.0, 1.0]] * 5])
    for wrong_steps, tail in ((4, ""), (5, "; and 1 more")):
        tokens = torch.zeros(1, 5, dtype=torch.long)  # every step off its argmax (token 1)
        lengths = torch.tensor([wrong_steps])
        logp = torch.log_softmax(logits, dim=-1)[..., 0]
        rollout = loop.Rollout(tokens, logp, logits, lengths, torch.tensor([2]), ())
        verdict = comparisons.oracle_verdict({"fast": rollout}, (), close(atol=1e-6, rtol=0.0))
        (fact,) = verdict.violated_facts
        assert fact.endswith(f"step 3 is not the fp64 argmax of its logits{tail})"), fact
        assert verdict.metrics["fast_steps_wrong"] == wrong_steps


NAN_FACT = "NaN planted in every unused slot before the run and every dead slot after prefill"


class EverySlotLive(Wrapped):
    """A layout claiming every slot is a valid key: the NaN probe has nowhere to plant."""

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        return torch.arange(width + self.steps)


def test_nan_probe_that_planted_nothing_proves_nothing() -> None:
    backend = ar_models.backend("fake", "read_safe")
    batch = right_padded_batch(prompt_ids((4, 6), seed=60), PAD)
    reference = loop.stock_rollout(backend, batch.prompts(), 2)
    live = EverySlotLive(backend)
    live.steps = 2
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    verdict = comparisons.compare_nan_unused_slots(live, batch, 2, policies, reference)
    assert verdict.metrics["poisoned_slots"] == 0 and NAN_FACT in verdict.violated_facts
    assert FINITE_FACT not in verdict.violated_facts


def test_nan_probe_of_one_static_row_with_one_unused_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = ar_models.backend("fake", "read_safe")
    batch = right_padded_batch(prompt_ids((6,), seed=61), PAD)
    reference = loop.stock_rollout(backend, batch.prompts(), 1)
    monkeypatch.setattr(ar_cache, "cache_is_dynamic", lambda batch_size: False)
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    verdict = comparisons.compare_nan_unused_slots(backend, batch, 1, policies, reference)
    assert verdict.metrics["poisoned_slots"] == 1 and NAN_FACT not in verdict.violated_facts


def test_shipped_backends_register_into_the_given_registry() -> None:
    from harness.ar import plugins as ar_plugins
    from harness.ar.backends import TransformersBackend, UpstreamBackend

    seen = []
    registry = SimpleNamespace(register=lambda name, obj, origin: seen.append((name, obj, origin)))
    ar_plugins.register(SimpleNamespace(AR_BACKENDS=registry))
    origin = "fastpath-parity (harness.ar.plugins)"
    assert seen == [(ar_plugins.REMOTE_CODE, UpstreamBackend, origin), (ar_plugins.TRANSFORMERS, TransformersBackend,
                                                                        origin)]


FOOTPRINT_FACT = "finished rows wrote no KV after their EOS (cache footprint checked)"
FINITE_FACT = "every logit finite: no masked-out slot was read"


def test_finished_rows_fact_sees_a_stray_write() -> None:
    backend = ar_models.backend("fake")
    batch, eos, _ = _early_stop(backend, (5, 8), 55, {0: 1}, 4)
    reference = loop.stock_rollout(backend, batch.prompts(), 4, eos)
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    stray = StrayWrite(backend, 0, [11], 0.5)  # row 0 owns slots 5, 6 after the prefill
    verdict = comparisons.compare_finished_rows(stray, batch, 4, eos, policies, reference)
    assert verdict.violated_facts == [FOOTPRINT_FACT] and verdict.metrics["stray_writes"] == {"0": [11]}


def test_nan_fact_sees_a_mask_that_reads_pads() -> None:
    backend = ar_models.backend("fake", "read_safe")
    batch = right_padded_batch(prompt_ids((4, 6), seed=64), PAD)
    reference = loop.stock_rollout(backend, batch.prompts(), 3)
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    verdict = comparisons.compare_nan_unused_slots(AdmitsPads(backend), batch, 3, policies, reference)
    assert FINITE_FACT in verdict.violated_facts and verdict.metrics["nonfinite_logits"] == 2 * V


def test_one_stop_eos_is_first_emitted_mid_rollout_by_one_row_only() -> None:
    """The EOS may recur later in its own row (the row stops at its first), never in another row or at an edge."""
    assert eos_for_one_stop(torch.tensor([[94, 95, 67, 95, 67]])) == (67,)  # 95 came at step 1 first: step 2 wins
    assert eos_for_one_stop(torch.tensor([[1, 2, 3, 4, 5], [6, 3, 8, 9, 10]])) == (8,)  # 3 is in both rows
    assert eos_for_one_stop(torch.tensor([[1, 1, 1, 2], [3, 3, 3, 3]])) == ()  # nothing starts mid-rollout



def test_a_step_that_does_not_advance_stops_the_rollout_instead_of_spinning(monkeypatch) -> None:
    backend = ar_models.backend("fake")
    monkeypatch.setattr(loop, "step", lambda state: None)
    with deadline(8.0), pytest.raises(RuntimeError, match="not done after 3 steps .*a step did not advance it"):
        loop.fast_rollout(backend, right_padded_batch(prompt_ids((4, 6), seed=54), PAD), 3)


@pytest.mark.cpu
def test_a_rollout_under_inference_mode_is_the_same_rollout():
    """Inference tensors carry no version counter, so the finished-rows read is recounted every step there: the
    rollout (two rows stopping at EOS on the way) is the one torch.no_grad gives."""
    backend = ar_models.backend("fake")
    prompts = prompt_ids((5, 9, 3), seed=71)
    reference = loop.stock_rollout(backend, prompts, 6)
    eos, ends = eos_for_stops(reference.tokens, {0: 2, 2: 4})
    batch = right_padded_batch(prompts, backend.pad_id)
    plain = loop.fast_rollout(backend, batch, 6, eos)
    with torch.inference_mode():
        inferred = loop.fast_rollout(backend, batch, 6, eos)
    assert torch.equal(inferred.tokens, plain.tokens) and torch.equal(inferred.lengths, plain.lengths)
    assert inferred.lengths.tolist() == ends and ends != [6, 6, 6]  # rows did stop early
