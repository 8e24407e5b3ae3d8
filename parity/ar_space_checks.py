"""Parity checks of the ar path over its input space (registered into harness.judging.checks).

One check per point of ``fixtures.ar_space.POINTS``, a pairwise covering of the ar axes plus a draw seeded by the
commit (``PARITY_SPACE=full``: every point):
``ar.space.<model>-<padding_side>-<dtype>-<kernel>-<eos>-<capacity>.batched_vs_b1``, the batched rollout of
``fixtures.ar_space.CASE`` padded on that side, on that model with its weights in that dtype under that attention
kernel, given EOS ids that stop one row near the middle (``mid``) or one row at its first token
(``first``), over a static cache of exactly width + new tokens slots per row, of whole 64-slot blocks, or of a
maximum length (``capacity``), against per-row B=1 runs of the same backend stopped at the same EOS ids:

- float32: tokens exact; log-probs, the prompt's KV and the KV of every token a row fed back within TOLERANCE_K x
  the stock prefill floor at the case's shape (the case checks' policy, ``parity.ar_checks``);
- bfloat16: the gpu tier's rule, each row's KL(B=1 || batched) against that row's own dtype control (the same stock
  B=1 computation in bf16 and in fp32) and flips only at near-ties, and the KV of the prompt and of every token fed
  in a context both runs share within TOLERANCE_K x the KV's dtype control (``harness.ar.judge.judge_low_precision``);
  each control held under its ceiling;
- both: the rollout's own record against an fp64 softmax of its logits (every recorded log-prob the full-softmax
  log-prob of its token, every token their argmax, no row past its EOS), every row holding exactly the KV of its
  prompt and fed tokens, and the path facts (the layout, no prefill query row without a key, every forward at the
  batch over a static cache).

Under the eager kernel a prefill query row that admits no key is NaN, and the next layer writes it into the KV every
row reads: such a mask fails in the numbers there, and on the mask fact under either kernel. The rollout under test
is resolved through ``harness.plugins.conformance`` (``harness.ar.comparisons``): under ``--impl ar=...`` each point
judges the implementation of its layout. B=1 references, floors and controls are seam-free and cached; the batched
rollout runs inside the check.
"""

from __future__ import annotations

import functools

from fixtures import ar_models, ar_space
from fixtures.ar_cases import eos_for_first_token, eos_for_one_stop, stopped_at_eos
from fixtures.ar_space import CASE
from harness.ar import comparisons, judge, loop
from harness.ar import policies as ar_policies
from harness.ar.left_padded import left_padded_batch
from harness.judging import floors, space
from harness.judging.checks import register
from harness.judging.compare import Policy, Verdict, close
from harness.judging.floors import module_reduction_terms
from harness.plugins import conformance
from parity import ar_checks

QUANTITIES = ("tokens", "logp", "prefill_kv", "generated_kv")  # float32: the case checks' quantities, every KV slot


def _backend(model: str, kernel: str, dtype: str):
    return ar_models.backend(model, kernel, dtype)


@functools.cache
def _unstopped(model: str, kernel: str, dtype: str) -> loop.Rollout:
    return loop.stock_rollout(_backend(model, kernel, dtype), CASE.prompts(), CASE.max_new_tokens)


@functools.cache
def _eos(model: str, kernel: str, dtype: str, eos: str) -> tuple[int, ...]:
    """The EOS ids of the point: one row stops near the middle (``mid``), or at its first token (``first``)."""
    tokens = _unstopped(model, kernel, dtype).tokens
    found = eos_for_one_stop(tokens) if eos == "mid" else eos_for_first_token(tokens)
    if not found:
        raise ValueError(f"ar space case on {model} ({dtype}, {kernel}): no EOS id stops a row {eos!r} while another "
                         "goes on; pick another seed for fixtures.ar_space.CASE")
    return found


@functools.cache
def _reference(model: str, kernel: str, dtype: str, eos: str) -> loop.Rollout:
    """Stock B=1 on each unpadded prompt, stopped at the point's EOS ids."""
    return stopped_at_eos(_unstopped(model, kernel, dtype), _eos(model, kernel, dtype, eos), ar_models.PAD_ID)


@functools.cache
def _fp32_policies(model: str, kernel: str) -> ar_policies.ARPolicies:
    """The case checks' fp32 policies, on the stock prefill floor at the case's rows and width under the kernel."""
    floor = ar_policies.stock_prefill_floor(_backend(model, kernel, "float32"), rows=CASE.batch_size,
                                            length=max(CASE.lengths))
    return ar_policies.fp32_policies(floor)


@functools.cache
def _dtype_controls(model: str, kernel: str, dtype: str, eos: str) -> tuple[judge.DtypeControl, floors.StockFloor]:
    """The logits' dtype control (per row KL, the log-prob floor) and the KV's, on stock B=1 runs of the point."""
    backend = _backend(model, kernel, dtype)
    reference, prompts = _reference(model, kernel, dtype, eos), CASE.prompts()
    terms = module_reduction_terms(backend.model, sequence=max(CASE.lengths) + CASE.max_new_tokens)
    return (judge.dtype_control(backend, prompts, reference, terms + backend.vocab_size),
            judge.kv_dtype_floor(backend, prompts, reference, terms))


def _oracle(reference: loop.Rollout) -> Policy:
    scale = float(reference.logits.abs().max())
    return close(atol=ar_checks.ORACLE_ULPS * ar_policies.FP32_EPS * scale, rtol=0.0, reason=(
        f"fp32 log_softmax of the recorded logits vs fp64: {ar_checks.ORACLE_ULPS:g} fp32 ulps of the stock run's "
        f"max |logit| {scale:.3g}"))


def _check(point: dict[str, str]) -> Verdict:
    model, side, dtype, kernel, eos, _capacity = (point[name] for name in ar_space.AXES)
    backend, reference = _backend(model, kernel, dtype), _reference(model, kernel, dtype, eos)
    if dtype == "float32":
        policies = _fp32_policies(model, kernel)

        def judged(fast: loop.Rollout, ref: loop.Rollout) -> Verdict:
            return judge.compare_cases(QUANTITIES, fast, ref, policies)
    else:
        control, kv_floor = _dtype_controls(model, kernel, dtype, eos)

        def judged(fast: loop.Rollout, ref: loop.Rollout) -> Verdict:
            return judge.judge_low_precision(fast, ref, control, kv_floor, k=ar_policies.BF16_KL_K,
                                             floor=ar_policies.BF16_KL_FLOOR, flip_margin=ar_policies.FLIP_MARGIN)
    prompts = CASE.prompts()
    batch = left_padded_batch(prompts, ar_models.PAD_ID) if side == "left" else CASE.batch()
    return comparisons.compare_point(backend, batch, CASE.max_new_tokens, _eos(model, kernel, dtype, eos),
                                     reference, judged, _oracle(reference),
                                     cache_slots=ar_space.cache_slots(point, batch.width, CASE.max_new_tokens))


FP32_POLICY = (f"{ar_checks.FP32_POLICY}; the KV of the prompt and of every fed token; the record against an fp64 "
               f"softmax ({ar_checks.ORACLE_ULPS:g} fp32 ulps of max |logit|)")
BF16_POLICY = (f"per row, KL(B=1 || batched) <= {ar_policies.BF16_KL_K:g} x that row's KL(fp32 || bf16) of stock B=1 + "
               f"{ar_policies.BF16_KL_FLOOR:g}, flips only under a top-1/top-2 margin of {ar_policies.FLIP_MARGIN:g}; "
               f"KV within {ar_policies.TOLERANCE_K:g} x its dtype control; the record against an fp64 softmax "
               f"({ar_checks.ORACLE_ULPS:g} fp32 ulps of max |logit|)")
NOT_SIZED_BY_THE_CALLER = (
    "the cache's capacity is the implementation's own choice: the contract passes no capacity, so only the suite's "
    "rollout is sized here (an implementation's is judged at whatever it allocates, on the exact-capacity points; "
    "the probes accept any capacity of at least width + new tokens)")
_BF16_FLOOR = ("1 bf16 ulp of the compared values' magnitude (max |log-prob|, max |KV|), each measured by its dtype "
               "control: stock B=1 in bf16 vs fp32")
_BF16_CEILING = ("8 sqrt(K) bf16 ulps of the same magnitude, K = the model's Linear fan-ins plus the keys (plus the "
                 "vocabulary's log-sum-exp for log-probs)")

for _point in ar_space.POINTS:
    _id = str(ar_space.check_id(_point))
    _bf16 = _point["dtype"] != "float32"
    register(_id, policy=BF16_POLICY if _bf16 else FP32_POLICY,
             doc=f"batched vs per-row B=1 at {space.describe(_point)}")(functools.partial(_check, dict(_point)))
    space.at(_id, **_point)
    if _point["padding_side"] == "left":
        conformance.judges_layout(_id, "ar", "left")
    if _point["capacity"] != "exact":
        conformance.not_judged(_id, NOT_SIZED_BY_THE_CALLER)
    if _bf16:
        floors.declare(_id, _BF16_FLOOR, _BF16_CEILING)
