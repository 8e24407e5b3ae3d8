"""The comparisons behind every ar check, model-agnostic so the GPU tier reuses them with real weights.

Each function runs the batched path under a forward spy, compares it with the stock reference it is given
(B=1 runs of the same prompts) under the given policies, and ANDs in the facts proving the path that ran. The
batch's type names its layout (a right-padded ``ARBatch`` or a ``LeftPaddedBatch``): each layout has its own
default rollout and slot layout, one set of judges, and a verdict that requires the model's prefill rows to have
been padded on that side (``judge.require_layout``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness.ar import judge, left_padded, loop, probes
from harness.ar import policies as ar_policies
from harness.ar.batch import ARBatch
from harness.ar.replay import teacher_forced_logp
from harness.ar.spy import ARForwardSpy
from harness.judging.compare import Policy, Verdict, raises
from harness.plugins import conformance

__all__ = [
    "CASE_QUANTITIES",
    "check_greedy_logp_oracle",
    "check_missing_real_pos",
    "compare_batched",
    "compare_finished_rows",
    "compare_growth",
    "compare_nan_unused_slots",
    "compare_padded_b1",
    "compare_point",
    "compare_rollout_vs_replay",
    "oracle_verdict",
]


# a batch of either layout: right-padded (the default) or left-padded
Batch = ARBatch | left_padded.LeftPaddedBatch

# what compare_batched judges of one case: the sampled tokens, their log-probs, the prefill KV, the first slot
CASE_QUANTITIES = ("tokens", "logp", "prefill_kv", "slot0")


def fast_rollout(padding_side: str = "right") -> Any:
    """The rollout under test: the suite's rollout of that layout (``loop.fast_rollout``, or
    ``left_padded.fast_left_rollout``) or a user's, via ``--impl ar=...``."""
    default = left_padded.fast_left_rollout if padding_side == "left" else loop.fast_rollout
    return conformance.resolve("ar", default)


def _side(batch: Batch) -> str:
    return left_padded.padding_side(batch)


def probe_backend(backend: Any, batch: Batch) -> Any:
    """What the cache probes read the batch's slot layout from: the backend itself, or its left-padded layout."""
    return left_padded.layout_for(backend) if _side(batch) == "left" else backend


def _on(backend: Any, rollout_fn: Any) -> Any:
    """``rollout_fn`` called with ``backend`` whatever backend view a probe hands it: the probes read the layout's
    slots through ``probe_backend``, the implementation under test gets the backend itself."""
    def rollout(_view: Any, batch: Batch, max_new_tokens: int, eos: Sequence[int]) -> loop.Rollout:
        return rollout_fn(backend, batch, max_new_tokens, eos)

    return rollout


class LayoutMismatch(RuntimeError):
    """The implementation raised after handing the model rows padded on the other side than it is judged by."""


class DynamicCacheAtBatch(AssertionError):
    """The implementation raised inside a dynamic cache it handed more than one row: upstream's B == 1 assertion,
    named (it carries no message of its own)."""


def _fast(backend: Any, batch: Batch, max_new_tokens: int, eos: Sequence[int] = (), cache_slots: int | None = None):
    """The implementation under test under the forward spy: a user's callable that never runs the model's
    forwards at the batch fails the path facts; one that raised after a prefill on rows padded on the other side
    raises naming that layout mismatch, one that raised inside a dynamic cache holding several rows names that
    (its own error chained either way)."""
    rollout_fn = fast_rollout(_side(batch))
    if cache_slots is not None:
        rollout_fn = functools.partial(rollout_fn, cache_slots=cache_slots)
    with ARForwardSpy(backend.model, pad_id=backend.pad_id) as spy:
        try:
            rollout = rollout_fn(backend, batch, max_new_tokens, tuple(eos))
        except Exception as err:
            mismatch = judge.layout_mismatch(spy, _side(batch))
            if mismatch:
                raise LayoutMismatch(mismatch) from err
            dynamic = judge.dynamic_cache_batch(err)
            if dynamic:
                raise DynamicCacheAtBatch(dynamic) from err
            raise
    return rollout, spy


def _require_path(verdict: Verdict, spy: ARForwardSpy, batch: Batch) -> Verdict:
    return judge.require_path(verdict, spy, batch.batch_size, padding_side=_side(batch))


def compare_batched(what: str, backend: Any, batch: Batch, max_new_tokens: int,
                    policies: ar_policies.ARPolicies, reference: loop.Rollout, eos: Sequence[int] = ()) -> Verdict:
    """One quantity (tokens / logp / prefill_kv / slot0) of the batched rollout vs per-row B=1 runs (the
    reference stopped at ``eos`` like the rollout)."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    verdict = judge.compare_case(what, fast, reference, policies)
    return _require_path(verdict, spy, batch)


def compare_padded_b1(backend: Any, batch: Batch, max_new_tokens: int,
                      policies: ar_policies.ARPolicies, reference: loop.Rollout, eos: Sequence[int] = ()) -> Verdict:
    """A padded B=1 prompt through the fast path equals the unpadded prompt's stock run: tokens, log-probs and the
    KV of the prompt and of every fed token."""
    if batch.batch_size != 1 or batch.real_pos is None or int(batch.real_pos[0, 0]) >= batch.width:
        raise ValueError("compare_padded_b1 needs one padded row (real_pos < width)")
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    verdict = judge.compare_cases(("tokens", "logp", "prefill_kv", "generated_kv"), fast, reference, policies)
    return _require_path(verdict, spy, batch)


def compare_rollout_vs_replay(backend: Any, batch: Batch, max_new_tokens: int,
                              policy: Policy, eos: Sequence[int] = ()) -> Verdict:
    """The batched rollout's recorded log-probs equal a teacher-forced, unpadded replay of its own tokens."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    replayed = teacher_forced_logp(backend, batch.prompts(), fast)
    verdict = policy.judge(fast.logp, replayed, dims=("row", "step"), what="rollout vs replay log_probs")
    return _require_path(verdict, spy, batch)


def stop_fact(lengths: Sequence[int], ref_lengths: Sequence[int]) -> str:
    """The finished-rows fact, naming every row that stopped elsewhere than its B=1 run and both lengths (a row one
    side lacks has no length there: a rollout that dropped or added a row is named, not a crash)."""
    wrong = [f"row {row} emitted {'no' if n is None else n} tokens, its B=1 run {'none' if m is None else m}"
             for row, (n, m) in enumerate(itertools.zip_longest(lengths, ref_lengths)) if n != m]
    return "every row stops where its B=1 run stopped at EOS" + (f" ({'; '.join(wrong)})" if wrong else "")


def compare_finished_rows(backend: Any, batch: Batch, max_new_tokens: int, eos: Sequence[int],
                          policies: ar_policies.ARPolicies, reference: loop.Rollout) -> Verdict:
    """Rows that emit EOS stop sampling and stop writing KV; each equals its B=1 run stopped at EOS (tokens and
    log-probs; the cache footprint holds what each row wrote). Generated tokens' KV is compared where the check's
    floor covers its arithmetic (the space checks' short rollouts, the padded B=1 row): after a long decode the
    prefill's batch-shape floor no longer bounds it (measured 1.02 x its tolerance on one stack)."""
    run = probes.footprint_rollout(probe_backend(backend, batch), batch, max_new_tokens, tuple(eos),
                                   rollout=_on(backend, fast_rollout(_side(batch))))
    fast = run.rollout
    verdict = judge.compare_cases(("tokens", "logp"), fast, reference, policies)
    lengths, ref_lengths = fast.lengths.tolist(), reference.lengths.tolist()
    verdict = verdict.require(lengths == ref_lengths, stop_fact(lengths, ref_lengths),
                              lengths=lengths, reference_lengths=ref_lengths)
    early = min(ref_lengths) < max(ref_lengths)  # lengths never exceed max_new_tokens: the shortest stopped early
    verdict = verdict.require(early, "a row finished while another kept generating (masking exercised)")
    verdict = verdict.require(run.static and not run.stray_writes,
                              "finished rows wrote no KV after their EOS (cache footprint checked)",
                              stray_writes={str(k): v for k, v in run.stray_writes.items()},
                              stray_slots=sum(len(v) for v in run.stray_writes.values()))
    return _require_path(verdict, run.spy, batch)


def compare_nan_unused_slots(backend: Any, batch: Batch, max_new_tokens: int,
                             policies: ar_policies.ARPolicies, reference: loop.Rollout,
                             eos: Sequence[int] = ()) -> Verdict:
    """NaN in every unused or dead cache slot; every logit stays finite and the tokens stay right."""
    run = probes.nan_probe_rollout(probe_backend(backend, batch), batch, max_new_tokens, tuple(eos),
                                   rollout=_on(backend, fast_rollout(_side(batch))))
    verdict = judge.compare_case("tokens", run.rollout, reference, policies)
    verdict = verdict.require(run.static and run.poisoned_slots > 0,
                              "NaN planted in every unused slot before the run and every dead slot after prefill",
                              poisoned_slots=run.poisoned_slots)
    verdict = verdict.require(run.nonfinite_logits == 0, "every logit finite: no masked-out slot was read",
                              nonfinite_logits=run.nonfinite_logits)
    finite_kv = all(bool(torch.isfinite(kv).all()) for kv in run.rollout.kv)
    verdict = verdict.require(finite_kv, "every valid KV slot finite")
    return _require_path(verdict, run.spy, batch)


def check_missing_real_pos(backend: Any, batch: ARBatch, max_new_tokens: int,
                           eos: Sequence[int] = ()) -> Verdict:
    """Without tokenizer_output.real_pos the rollout refuses to start with a ValueError naming real_pos (at any
    batch size), before any forward."""
    rollout_fn = fast_rollout()
    with ARForwardSpy(backend.model) as spy:
        verdict = raises(lambda: rollout_fn(backend, batch.without_real_pos(), max_new_tokens,
                                    tuple(eos)), ValueError, match="real_pos")
    return verdict.require(not spy.calls, "refused before any forward", forwards=len(spy.calls))


def _oracle_errors(rollout: loop.Rollout, eos: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Recorded vs fp64 oracle over every emitted step: (recorded logp, oracle logp, each step that is wrong, in
    words: off the fp64 argmax, or emitted after the row's own EOS)."""
    recorded, oracle, wrong = [], [], []
    for row in range(rollout.tokens.shape[0]):
        n = int(rollout.lengths[row])
        logits64 = rollout.logits[row, :n].double()
        tokens = rollout.tokens[row, :n]
        logp64 = torch.log_softmax(logits64, dim=-1)
        oracle.append(logp64.gather(-1, tokens[:, None])[:, 0])
        recorded.append(rollout.logp[row, :n].double())
        ended = next((step for step, token in enumerate(tokens.tolist()) if token in eos), None)
        if ended is not None and ended < n - 1:
            wrong.append(f"row {row} went on {n - 1 - ended} step(s) past its EOS at step {ended}")
        for step in (logits64.argmax(dim=-1) != tokens).nonzero().flatten().tolist():
            wrong.append(f"row {row} step {step} is not the fp64 argmax of its logits")
    return torch.cat(recorded), torch.cat(oracle), wrong


def oracle_verdict(rollouts: dict[str, loop.Rollout], eos: Sequence[int], policy: Policy) -> Verdict:
    """Each rollout's record against an fp64 softmax of its own logits (``rollouts``: label -> rollout): every
    recorded log-prob the full-softmax log-prob of its token under ``policy``, every token their argmax, no row
    going on past its EOS. It holds whatever the model's dtype: the log-prob is taken from the logits as recorded
    (fp32, which holds bf16 and fp16 exactly), never in the model's dtype."""
    recorded, oracle, wrong, counts = [], [], [], {}
    for label, rollout in rollouts.items():
        rec, orc, steps = _oracle_errors(rollout, eos)
        recorded.append(rec)
        oracle.append(orc)
        wrong.extend(f"{label} {w}" for w in steps)
        counts[f"{label}_steps_wrong"] = len(steps)
    verdict = policy.judge(torch.cat(recorded), torch.cat(oracle), dims=("step",),
                           what="recorded log-prob vs fp64 softmax")
    shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    fact = "every token is the fp64 argmax of its logits, and no row goes on past its EOS"
    return verdict.require(not wrong, f"{fact} ({shown})" if wrong else fact, **counts)


def check_greedy_logp_oracle(backend: Any, batch: Batch, max_new_tokens: int,
                             policy: Policy, eos: Sequence[int] = ()) -> Verdict:
    """Both rollouts' greedy picks and recorded log-probs against an fp64 softmax of their own logits.

    Parity compares fast with stock, and both record through ``loop.token_logprob``; this is the independent
    oracle for that shared piece. The stock run is made here, uncached, so an ablation cannot poison a cache."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    stock = loop.stock_rollout(backend, batch.prompts(), max_new_tokens, tuple(eos))
    return _require_path(oracle_verdict({"fast": fast, "stock": stock}, eos, policy), spy, batch)


def compare_point(backend: Any, batch: Batch, max_new_tokens: int, eos: Sequence[int], reference: loop.Rollout,
                  judge_rollout: Callable[[loop.Rollout, loop.Rollout], Verdict], oracle: Policy, *,
                  cache_slots: int | None = None) -> Verdict:
    """The batched rollout at one point of the ar input space (a model in a dtype under an attention kernel, a
    layout, where EOS comes) against per-row B=1 runs of the same backend: ``judge_rollout(fast, reference)`` (the
    dtype's rule over tokens, log-probs and the KV of every prompt and fed token), the rollout's own record against
    an fp64 softmax of its logits (``oracle_verdict``) and the path facts. ``cache_slots`` sizes the static cache
    of the suite's own rollout (``harness.ar.loop.init_state``); the contract passes an implementation none."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos, cache_slots=cache_slots)
    verdict = judge_rollout(fast, reference).merge(oracle_verdict({"fast": fast}, eos, oracle))
    if cache_slots is not None:
        seen = sorted({c.slots for c in spy.calls if c.slots is not None})
        verdict = verdict.require(seen == [cache_slots], f"every forward ran over the {cache_slots}-slot cache",
                                  cache_slots_seen=str(seen))
    return _require_path(verdict, spy, batch)


def compare_growth(backend: Any, batch: Batch, max_new_tokens: int, eos: Sequence[int], reference: loop.Rollout,
                   control_logp: torch.Tensor, terms: int) -> Verdict:
    """The per-step log-prob error curve of the batched rollout against the growth of the stock floor curve
    ``control_logp`` (``judge.judge_growth``, the control held under its ceiling for ``terms`` reduction terms)."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    verdict = judge.judge_growth(fast, reference, control_logp, terms=terms)
    return _require_path(verdict, spy, batch)
