"""The comparisons behind every ar check, model-agnostic so the GPU tier reuses them with real weights.

Each function runs the batched path under a forward spy, compares it with the stock reference it is given
(B=1 runs of the same prompts) under the given policies, and ANDs in the facts proving the path that ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness import conformance
from harness.ar import judge, loop, probes
from harness.ar import policies as ar_policies
from harness.ar.batch import ARBatch
from harness.ar.replay import teacher_forced_logp
from harness.ar.spy import ARForwardSpy
from harness.compare import Policy, Verdict, raises

__all__ = [
    "CASE_QUANTITIES",
    "check_greedy_logp_oracle",
    "check_missing_real_pos",
    "compare_batched",
    "compare_finished_rows",
    "compare_nan_unused_slots",
    "compare_padded_b1",
    "compare_rollout_vs_replay",
]


# what compare_batched judges of one case: the sampled tokens, their log-probs, the prefill KV, the first slot
CASE_QUANTITIES = ("tokens", "logp", "prefill_kv", "slot0")


def fast_rollout() -> Any:
    """The rollout under test: the suite's ``fast_rollout`` or a user's, via ``--impl ar=...``."""
    return conformance.resolve("ar", loop.fast_rollout)


def _fast(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = ()):
    """The implementation under test under the forward spy: a user's callable that never runs the model's
    forwards at the batch fails the path facts."""
    rollout_fn = fast_rollout()
    with ARForwardSpy(backend.model) as spy:
        rollout = rollout_fn(backend, batch, max_new_tokens, tuple(eos))
    return rollout, spy


def compare_batched(what: str, backend: Any, batch: ARBatch, max_new_tokens: int,
                    policies: ar_policies.ARPolicies, reference: loop.Rollout, eos: Sequence[int] = ()) -> Verdict:
    """One quantity (tokens / logp / prefill_kv / slot0) of the batched rollout vs per-row B=1 runs (the
    reference stopped at ``eos`` like the rollout)."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    verdict = judge.compare_case(what, fast, reference, policies)
    return judge.require_path(verdict, spy, batch.batch_size)


def compare_padded_b1(backend: Any, batch: ARBatch, max_new_tokens: int,
                      policies: ar_policies.ARPolicies, reference: loop.Rollout, eos: Sequence[int] = ()) -> Verdict:
    """A right-padded B=1 prompt through the fast path equals the unpadded prompt's stock run."""
    if batch.batch_size != 1 or batch.real_pos is None or int(batch.real_pos[0, 0]) >= batch.width:
        raise ValueError("compare_padded_b1 needs one right-padded row (real_pos < width)")
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    verdict = judge.compare_case("tokens", fast, reference, policies)
    for what in ("logp", "prefill_kv"):
        verdict = verdict.merge(judge.compare_case(what, fast, reference, policies))
    return judge.require_path(verdict, spy, 1)


def compare_rollout_vs_replay(backend: Any, batch: ARBatch, max_new_tokens: int,
                              policy: Policy, eos: Sequence[int] = ()) -> Verdict:
    """The batched rollout's recorded log-probs equal a teacher-forced, unpadded replay of its own tokens."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    replayed = teacher_forced_logp(backend, batch.prompts(), fast)
    verdict = policy.judge(fast.logp, replayed, dims=("row", "step"), what="rollout vs replay log_probs")
    return judge.require_path(verdict, spy, batch.batch_size)


def stop_fact(lengths: Sequence[int], ref_lengths: Sequence[int]) -> str:
    """The finished-rows fact, naming every row that stopped elsewhere than its B=1 run and both lengths."""
    wrong = [f"row {row} emitted {n} tokens, its B=1 run {m}"
             for row, (n, m) in enumerate(zip(lengths, ref_lengths, strict=True)) if n != m]
    return "every row stops where its B=1 run stopped at EOS" + (f" ({'; '.join(wrong)})" if wrong else "")


def compare_finished_rows(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int],
                          policies: ar_policies.ARPolicies, reference: loop.Rollout) -> Verdict:
    """Rows that emit EOS stop sampling and stop writing KV; each equals its B=1 run stopped at EOS."""
    run = probes.footprint_rollout(backend, batch, max_new_tokens, tuple(eos), rollout=fast_rollout())
    fast = run.rollout
    verdict = judge.compare_case("tokens", fast, reference, policies)
    verdict = verdict.merge(judge.compare_case("logp", fast, reference, policies))
    lengths, ref_lengths = fast.lengths.tolist(), reference.lengths.tolist()
    verdict = verdict.require(lengths == ref_lengths, stop_fact(lengths, ref_lengths),
                              lengths=lengths, reference_lengths=ref_lengths)
    early = min(ref_lengths) < max(ref_lengths)  # lengths never exceed max_new_tokens: the shortest stopped early
    verdict = verdict.require(early, "a row finished while another kept generating (masking exercised)")
    verdict = verdict.require(run.static and not run.stray_writes,
                              "finished rows wrote no KV after their EOS (cache footprint checked)",
                              stray_writes={str(k): v for k, v in run.stray_writes.items()},
                              stray_slots=sum(len(v) for v in run.stray_writes.values()))
    return judge.require_path(verdict, run.spy, batch.batch_size)


def compare_nan_unused_slots(backend: Any, batch: ARBatch, max_new_tokens: int,
                             policies: ar_policies.ARPolicies, reference: loop.Rollout,
                             eos: Sequence[int] = ()) -> Verdict:
    """NaN in every unused or dead cache slot; every logit stays finite and the tokens stay right."""
    run = probes.nan_probe_rollout(backend, batch, max_new_tokens, tuple(eos), rollout=fast_rollout())
    verdict = judge.compare_case("tokens", run.rollout, reference, policies)
    verdict = verdict.require(run.static and run.poisoned_slots > 0,
                              "NaN planted in every unused slot before the run and every dead slot after prefill",
                              poisoned_slots=run.poisoned_slots)
    verdict = verdict.require(run.nonfinite_logits == 0, "every logit finite: no masked-out slot was read",
                              nonfinite_logits=run.nonfinite_logits)
    finite_kv = all(bool(torch.isfinite(kv).all()) for kv in run.rollout.kv)
    verdict = verdict.require(finite_kv, "every valid KV slot finite")
    return judge.require_path(verdict, run.spy, batch.batch_size)


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


def check_greedy_logp_oracle(backend: Any, batch: ARBatch, max_new_tokens: int,
                             policy: Policy, eos: Sequence[int] = ()) -> Verdict:
    """Both rollouts' greedy picks and recorded log-probs against an fp64 softmax of their own logits.

    Parity compares fast with stock, and both record through ``loop.token_logprob``; this is the independent
    oracle for that shared piece. The stock run is made here, uncached, so an ablation cannot poison a cache."""
    fast, spy = _fast(backend, batch, max_new_tokens, eos)
    stock = loop.stock_rollout(backend, batch.prompts(), max_new_tokens, tuple(eos))
    fast_rec, fast_oracle, fast_wrong = _oracle_errors(fast, eos)
    stock_rec, stock_oracle, stock_wrong = _oracle_errors(stock, eos)
    verdict = policy.judge(torch.cat([fast_rec, stock_rec]), torch.cat([fast_oracle, stock_oracle]),
                           dims=("step",), what="recorded log-prob vs fp64 softmax")
    wrong = [f"fast {w}" for w in fast_wrong] + [f"stock {w}" for w in stock_wrong]
    shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    fact = "every token is the fp64 argmax of its logits, and no row goes on past its EOS"
    verdict = verdict.require(not wrong, f"{fact} ({shown})" if wrong else fact,
                              fast_steps_wrong=len(fast_wrong), stock_steps_wrong=len(stock_wrong))
    return judge.require_path(verdict, spy, batch.batch_size)
