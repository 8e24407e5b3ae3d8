"""Ablations of the ar path: known bugs re-introduced over its seams.

The first six are the AR PR's defects and the AR issue's list (docs/contracts.md); ``ar.static_cache_at_b1`` and
``ar.real_pos_fallback`` undo two decisions of the seed's review (B=1 keeps upstream's dynamic cache;
real_pos is required at every batch size), so the B=1 and missing-real_pos checks have teeth too; the last one
adds a drift that compounds over decode steps (caught by the error-growth checks only, tests/ar/test_growth.py).
Two are input classes of the ar space (``fixtures.ar_space``): the log-softmax taken in the model's dtype (only a
bf16 point sees it) and the generated tokens' KV read back at the wrong slots (only a comparison of that KV sees it).
Each claims only the checks it was measured to kill; the reasons say why the others survive.
"""

from __future__ import annotations

import math

import torch

from fixtures import ar_space
from fixtures.ar_models import BACKENDS as MODELS
from harness.ar.batch import pad_seq
from harness.ar.comparisons import CASE_QUANTITIES
from harness.ar.loop import token_logprob
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId

_BATCHED = ("unequal_real_pos", "length_skew", "all_padded", "concat")
_TRANSFORMERS = tuple(m for m in MODELS if m != "fake")


def _ids(models, cases, quantities) -> list[str]:
    return [str(check) for check in CheckId.grid("ar", models, cases, quantities)]


def _whole_rollout(models) -> list[str]:
    return _ids(models, ("",), ("rollout_vs_replay", "finished_rows", "nan_unused_slots"))


def _no_decode_mask(key_valid: torch.Tensor) -> None:
    return None


def _append_at_tail(input_ids: torch.Tensor, tokens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    input_ids[:, -1] = tokens
    return input_ids


def _zero_pad_positions(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    return pad_seq(position_ids, length, position_ids.dim() - 1, 0)


def _always_dynamic(batch_size: int) -> bool:
    return True


def _never_dynamic(batch_size: int) -> bool:
    return False


def _last_column(real_pos: torch.Tensor, width: int) -> torch.Tensor:
    return torch.full_like(real_pos, width - 1)


def _keep_writing(finished: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(finished)


def _assume_unpadded(batch) -> torch.Tensor:
    if batch.real_pos is None:
        return torch.full((batch.batch_size,), batch.width, dtype=torch.long)
    return batch.real_pos.reshape(-1).long()


ablation(
    "ar.decode_mask_removed", "harness.ar.masks:decode_mask", _no_decode_mask,
    kills=["ar.gpu.batched_vs_b1", *_ids(MODELS, _BATCHED, ("tokens", "logp")), *_whole_rollout(MODELS),
           *_ids(_TRANSFORMERS, ("padded_b1",), ("equals_unpadded",))],
    why=("upstream deletes the gen_text decode mask; over a static cache each row then attends its stale pad KV "
         "and the never-written tail (the transformers models fall back to their own causal mask, which reads the "
         "holes). Prefill is untouched, so prefill_kv / slot0 survive; the fake's B=1 keeps the trimmed dynamic "
         "cache, where no mask is needed."),
    kill_mode="tolerance",
)

ablation(
    "ar.token_appended_at_tail", "harness.ar.loop:place_token", _append_at_tail,
    kills=[*_ids(("fake",), _BATCHED, ("tokens", "logp")), *_whole_rollout(("fake",)),
           "ar.fake.padded_b1.equals_unpadded"],
    why=("upstream re-reads the next input with input_ids.gather(1, position_ids) at real_pos_i + step: appended "
         "tokens feed every short row its own pad. In the transformers hole layout the tail column is the shared "
         "write slot, so appending is correct there."),
    kill_mode="tolerance",
)

ablation(
    "ar.position_ids_zero_padded", "harness.ar.batch:pad_positions", _zero_pad_positions,
    kills=_ids(("fake",), ("concat",), CASE_QUANTITIES),
    why=("position_ids are upstream's KV write index: zero-padding writes every pad's KV onto slot 0, last write "
         "wins (the AR PR saw slot 0 off by ~4). Only concat pads positions; transformers' caches write by their own "
         "counter, so a zero pad only moves the RoPE of masked-out pads there."),
    kill_mode="tolerance",
)

ablation(
    "ar.dynamic_cache_at_batch", "harness.ar.cache:cache_is_dynamic", _always_dynamic,
    kills=[*_ids(("fake",), _BATCHED, CASE_QUANTITIES), *_whole_rollout(("fake",)),
           *_ids(_TRANSFORMERS, _BATCHED, ("prefill_kv", "slot0"))],
    raises=(AssertionError, ValueError),
    why=("the AR issue's crash: upstream's dynamic cache asserts len(cache_position) == 1 at B > 1 (the declared "
         "AssertionError kills every fake batched check). A transformers DynamicCache still works in the hole "
         "layout until a row finishes: every rollout has a finished row, whose slot a dynamic cache cannot leave "
         "unwritten, so the loop refuses with a ValueError there."),
    kill_mode="raises",
)

ablation(
    "ar.static_cache_at_b1", "harness.ar.cache:cache_is_dynamic", _never_dynamic,
    kills=[*_ids(MODELS, ("b1",), CASE_QUANTITIES), *_ids(MODELS, ("padded_b1",), ("equals_unpadded",))],
    why=("B=1 must keep upstream's trimmed dynamic cache (the seed's review measured bf16 divergence at token 33 "
         "from a static cache alone); the spy sees a static cache. Caught by that fact on every claim, not by the "
         "numbers: under the fast path's decode mask a static cache computes the same function, and only the "
         "attention reduction's length changes, which rounds bitwise alike on some CPUs (MKL_CBWR=AVX2)."),
    kill_mode="fact",
    fact="B=1 kept the stock dynamic (trimmed) cache",
)

ablation(
    "ar.first_logits_last_column", "harness.ar.loop:first_logits_column", _last_column,
    kills=["ar.gpu.batched_vs_b1", *_ids(MODELS, _BATCHED, ("tokens", "logp")), *_whole_rollout(MODELS),
           *_ids(MODELS, ("padded_b1",), ("equals_unpadded",)), *ar_space.ids(padding_side="right")],
    why=("stock generation reads prefill logits at the last column: a right-padded row's first token is then "
         "sampled from its pad's logits. Rows with real_pos == L (b1) are unaffected; every right-padded point of "
         "the ar space pads two of its rows, in either dtype and kernel."),
    kill_mode="tolerance",
)

ablation(
    "ar.finished_rows_keep_writing", "harness.ar.loop:should_write_kv", _keep_writing,
    kills=_ids(MODELS, ("", "left"), ("finished_rows",)),
    why=("the AR issue's unfinished item: a row past EOS keeps writing KV. Its own mask hides the slots, so tokens "
         "survive; the cache footprint check sees the writes. The left-padded loop freezes finished rows through "
         "the same function."),
    kill_mode="fact",
    fact="finished rows wrote no KV after their EOS (cache",
)

ablation(
    "ar.real_pos_fallback", "harness.ar.loop:real_positions", _assume_unpadded,
    kills=["ar.missing_real_pos.b1", "ar.missing_real_pos.b4"],
    why=("the removed `real_pos is None` fallback assumed unpadded rows; the seed's review made real_pos required "
         "at every batch size because B=1 also re-fed the shifted prompt without it."),
    kill_mode="fact",
    fact="raises ValueError matching 'real_pos'",
)


def _logp_sign_flipped(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


ablation(
    "ar.logp_sign_flipped", "harness.ar.loop:token_logprob", _logp_sign_flipped,
    kills=_ids(MODELS, ("oracle", "left.oracle"), ("greedy_logp",)),
    why=("the recorded log-prob with its sign flipped, in the one function stock and fast (of both layouts) record "
         "through: the fast-vs-stock logp checks see the same wrong number on both sides; only the fp64 oracle sees "
         "it (rollout_vs_replay, whose replay computes its own log-probs, sees it too)."),
    kill_mode="tolerance",
)


def _model_dtype(backend) -> torch.dtype:
    return next(iter(backend.model.parameters())).dtype


def _logp_in_model_dtype(original):
    def recorded_logp(state):
        """The log-softmax of the logits as the model's dtype holds them, upcast after."""
        logits = state.logits
        state.logits = logits.to(_model_dtype(state.backend))
        try:
            return original(state).float()
        finally:
            state.logits = logits
    return recorded_logp


ablation(
    "ar.logp_in_model_dtype", "harness.ar.loop:recorded_logp", _logp_in_model_dtype, wraps=True,
    kills=ar_space.ids(dtype="bfloat16"),
    why=("the recorded log-prob taken by a log-softmax in the model's dtype, upcast to fp32 after: in bf16 the "
         "log-sum-exp keeps 8 bits, so each log-prob is off by about a bf16 ulp of its size, far over the fp64 "
         "oracle of the recorded logits. In fp32 the cast is the identity, so only a bf16 point sees it; a "
         "comparison with B=1 could not (the error sits under bf16's own batch-shape rounding), the rollout's own "
         "record against its logits does."),
    kill_mode="tolerance",
)


def _generated_kv_at_row_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
    return torch.arange(real_pos + generated)


_SPACE_TRANSFORMERS_RIGHT = [check for model in _TRANSFORMERS
                             for check in ar_space.ids(model=model, padding_side="right")]

ablation(
    "ar.generated_kv_read_at_row_slots", "harness.ar.backends:TransformersBackend.logical_slots",
    _generated_kv_at_row_slots,
    kills=[*_SPACE_TRANSFORMERS_RIGHT, *_ids(_TRANSFORMERS, ("padded_b1",), ("equals_unpadded",)),
           *_ids(_TRANSFORMERS, ("",), ("nan_unused_slots",))],
    modes=dict.fromkeys(_ids(_TRANSFORMERS, ("",), ("nan_unused_slots",)), "fact"),
    fact="every valid KV slot finite",
    why=("the rollout's KV read back with the per-row-slot rule (token k right after the row's prompt) on a "
         "transformers model, whose cache writes token k in the shared column W + k: a padded row's generated "
         "tokens' KV is read from its holes. Tokens, log-probs and the prompt's KV are untouched; only a comparison "
         "of the generated tokens' KV sees it (or the NaN probe, which poisons the holes)."),
    kill_mode="tolerance",
)


DRIFT_FROM = 34  # the picked logit rises by 2^(k - 34) of its magnitude at decode step k: 1.9e-6 at step 15


def _relative_drift(step: int) -> float:
    """fp32(1 + 2^(step - 34)) - 1: exactly 0 up to step 10, then doubling every step."""
    return float(torch.tensor(1.0 + math.ldexp(1.0, step - DRIFT_FROM), dtype=torch.float32)) - 1.0


def _logit_drift(original):
    def drifting_step(state):
        k = state.step_idx
        original(state)
        tokens = state.tokens[:, k]
        logits = state.logits[:, k]
        picked = logits.gather(-1, tokens[:, None])
        drifted = logits.scatter(-1, tokens[:, None], picked + picked.abs() * _relative_drift(k))
        changed = (drifted != logits).any(dim=-1) & (state.lengths == k + 1)  # rows that emitted at step k
        state.logits[:, k] = torch.where(changed[:, None], drifted, logits)
        state.logp[:, k] = torch.where(changed, token_logprob(drifted, tokens), state.logp[:, k])
    return drifting_step


def _eos_checked_when_decoding_only(original):
    """EOS tested in the decode branch only: a row whose prefill-sampled token is EOS goes on generating."""

    def sample(state, row_logits):
        finished_before = state.finished
        original(state, row_logits)
        if state.step_idx == 0:
            state.finished = finished_before

    return sample


ablation(
    "ar.first_token_eos_unchecked", "harness.ar.loop:_sample", _eos_checked_when_decoding_only, wraps=True,
    kills=_ids(MODELS, ("first_token_eos",), ("finished_rows",)),
    why=("the stop test lives in the decode branch only, so the token sampled from the prefill's logits is never "
         "compared with the EOS ids: a row that should end at once keeps generating"),
    kill_mode="fact",
    fact="every row stops where its B=1 run stopped at EOS",
)


ablation(
    "ar.logit_drift_per_step", "harness.ar.loop:step", _logit_drift, wraps=True,
    kills=_ids(MODELS, ("growth",), ("logp",)),
    why=("the batched path's picked-token logit rises by 2^(k - 34) of its magnitude at decode step k (a "
         "per-step state compounding): exactly 0 up to step 10, so the <= 7-token rollouts stay bitwise; under the "
         "worst-element logp tolerance on all 16 steps of the growth case, yet its per-step error curve grows far "
         "faster than the stock floor's. The raised argmax stays the token, and logits and log-probs are recorded "
         "consistently, so the fp64 oracle sees nothing either."),
    kill_mode="tolerance",
)


# ------------------------------------------------------------------- bugs in the stock path the controls share
# A model whose own forward computes another function at another batch: the stock prefill floor (the same prompts
# batched vs alone) measures the bug, not rounding, and lies above the ceiling the arithmetic allows.

_QWEN3_NORM = "transformers.models.qwen3.modeling_qwen3:Qwen3RMSNorm.forward"


def _single_row_path(original):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A "fast single-row kernel" at B=1 that scales by the mean |x| instead of the root mean square."""
        if hidden_states.shape[0] != 1:
            return original(self, hidden_states)
        x = hidden_states.float()
        return self.weight * (x / (x.abs().mean(-1, keepdim=True) + self.variance_epsilon)).to(hidden_states.dtype)
    return forward


def _batch_statistic(original):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The mean square taken over every row of the forward, not each token's own (a batch statistic)."""
        x = hidden_states.float()
        variance = x.pow(2).mean(dim=(0, -1), keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)
    return forward


_STOCK_BUG_CLAIMS = _ids(("qwen3",), _BATCHED, ("logp",))

ablation(
    "ar.norm_single_row_path", _QWEN3_NORM, _single_row_path, wraps=True, kills=_STOCK_BUG_CLAIMS,
    why="the model's norm takes another path at one row (as upstream's single-token expert path): stock B=1 and "
        "stock batched compute different functions, outside any MoE the routing probe looks at",
    kill_mode="fact", fact="the stock path itself depends on the batch composition", stock=True,
)
ablation(
    "ar.norm_batch_statistic", _QWEN3_NORM, _batch_statistic, wraps=True, kills=_STOCK_BUG_CLAIMS,
    why="the model's norm reads a statistic over the whole batch, so each row's output depends on what shares its "
        "forward (pad rows included)",
    kill_mode="fact", fact="the stock path itself depends on the batch composition", stock=True,
)


def _key_axis_of_the_rollout(self) -> int:
    return self.batch.width + self.max_new_tokens


_LONGER_CACHES = [*ar_space.ids(capacity="blocks"), *ar_space.ids(capacity="maximum")]

ablation(
    "ar.key_axis_sized_to_the_rollout", "harness.ar.loop:ARState.key_slots", _key_axis_of_the_rollout,
    kills=_LONGER_CACHES,
    raises=(RuntimeError, ValueError),
    why=("every forward's mask sized width + new tokens, not the cache's length: right whenever the cache holds "
         "exactly that, so only a cache allocated in whole blocks or once at a maximum length sees it, where the "
         "mask no longer spans the keys the cache returns"),
    kill_mode="raises",
)
