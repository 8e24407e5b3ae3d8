"""Backends: how the batched loop drives one family of models, and each family's stock B=1 loop.

- ``UpstreamBackend`` drives HunyuanImage-3-style remote code (the real ``modeling_hunyuan_image_3`` or the
  fake in ``fakes/``) through upstream's own ``prepare_inputs_for_generation`` /
  ``_update_model_kwargs_for_generation``. Layout: every row writes its own slots, ``position_ids`` is the write
  index, so row i's generated token k lands in slot ``real_pos_i + k``.
- ``TransformersBackend`` drives a transformers causal LM over transformers' own caches. Their cache writes one
  shared slot for all rows, so pads stay as holes: prefill fills slots ``[0, Lmax)``, generated token k lands
  in shared slot ``Lmax + k`` with RoPE position ``real_pos_i + k``, and the mask excludes each row's hole
  ``[real_pos_i, Lmax)``.

Both keep a token buffer whose column equals the token's cache slot, so ``place_token`` has one meaning.

``UpstreamBackend`` hands upstream's hooks what upstream's own ``generate`` hands them (``model_kwargs`` with
``tokenizer_output``, for the mask builder too) and sets on the model what ``generate`` sets (``post_token_len``).
It does not enter the CUDA autocast upstream's ``generate`` wraps gen_text in (bf16 for generation 1, the model
dtype for generation 2): every forward runs in the dtype the check asks for.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from harness.ar import cache as ar_cache
from harness.inputs import compat

if TYPE_CHECKING:
    from harness.ar.loop import ARState

__all__ = ["IMAGE_SLICE_FIELDS", "MODELING_MODULES", "StockRun", "TransformersBackend", "UpstreamBackend",
           "model_mask", "remote_code_generation", "remote_code_name", "shared_column_inputs", "shared_token_columns",
           "upstream_generation"]

#: The per-row image-slice lists of ``tokenizer_output`` that upstream's mask builders read (empty for text rows).
IMAGE_SLICE_FIELDS = ("joint_image_slices", "gen_image_slices", "vae_image_slices", "vit_image_slices")


@dataclass(frozen=True)
class StockRun:
    """One stock B=1 generation: ``tokens [n]``, ``logits [n, V]``, ``kv [layers, 2, H, T, hd]`` in slot order."""

    tokens: torch.Tensor
    logits: torch.Tensor
    kv: torch.Tensor


def _stack_kv(cache: Any, row: int, slots: torch.Tensor) -> torch.Tensor:
    """Row ``row``'s KV at ``slots`` for every layer -> ``[layers, 2, H, len(slots), hd]``."""
    return torch.stack([torch.stack([k[row][:, slots.to(k.device)], v[row][:, slots.to(v.device)]])
                        for k, v in ar_cache.layer_buffers(cache)])


def model_mask(model: Any, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool mask (True = may attend) as ``model``'s attention takes it: unchanged, except for transformers' eager
    attention, which adds its mask to the scores (a bool mask added as 0 and 1 would admit every key): there 0 where
    a key is admitted and -inf where it is not, in the model's dtype. -inf, not the dtype's lowest value, is what a
    bool mask means (never attend), so a query row that admits no key is NaN there, as under any eager -inf
    softmax, instead of an average over keys it was never meant to read."""
    config = getattr(model, "config", None)
    if mask is None or mask.dtype != torch.bool or getattr(config, "_attn_implementation", None) != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _check_row(rows: int, row: int) -> None:
    if rows < 1 or not 0 <= row < rows:
        raise ValueError(f"a stock control batch needs rows >= 1 and 0 <= row < rows, got rows={rows}, row={row}")


def _per_rollout(state: ARState, name: str, build: Callable[[], torch.Tensor], length: int) -> torch.Tensor:
    """A tensor a decode step needs, built once per rollout (kept in ``state.extra``) and rebuilt only when the
    length it was built for changes: each small op per step shows next to a tiny model's forward."""
    cached = state.extra.get(name)
    if cached is None or cached.shape[-1] != length:
        cached = state.extra[name] = build()
    return cached


def shared_column_inputs(state: ARState, first_positions: Callable[[], torch.Tensor],
                         writes_slots: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What decode step k of a shared-column layout feeds the model: column ``W + k - 1`` of ``state.input_ids``
    (every row's last token), each row's RoPE position ``first_positions()[i] + k - 1`` and, with ``writes_slots``,
    the write slot ``W + k - 1``. The per-step views are made once per rollout (``state.extra``) while the state
    holds the token buffer they view."""
    inputs = state.extra.get("shared_column_inputs")
    if inputs is None or inputs[0] is not state.token_buffer:
        width, device = state.batch.width, state.real_pos.device
        steps = torch.arange(state.max_new_tokens, device=device)
        inputs = state.extra["shared_column_inputs"] = (
            state.token_buffer, state.token_buffer[:, width:].split(1, dim=1),
            (first_positions()[:, None] + steps).split(1, dim=1), (width + steps).split(1) if writes_slots else None)
    _, columns, positions, slots = inputs
    k = state.step_idx - 1
    if state.input_ids._base is state.token_buffer:
        ids = columns[k]
    else:  # a loop that keeps its own token buffer in ``input_ids``: read the column there
        ids = state.input_ids[:, state.batch.width + k: state.batch.width + k + 1]
    return ids, positions[k], None if slots is None else slots[k]


def shared_token_columns(state: ARState) -> torch.Tensor:
    """Where step k's tokens go in a shared-column layout: column ``W + k`` of every row (views made once)."""
    columns = state.extra.get("shared_token_columns")
    if columns is None:
        width, device = state.batch.width, state.real_pos.device
        shared = torch.arange(width, width + state.max_new_tokens, device=device)
        columns = state.extra["shared_token_columns"] = shared[:, None].expand(-1, state.batch.batch_size).unbind(0)
    return columns[state.step_idx]


def _stops(eos: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(eos), dtype=torch.long, device=device)


def upstream_generation(model: Any) -> int:
    """Which generation of HunyuanImage-3 remote code ``model`` is, from what its ``forward`` takes.

    1: ``hunyuan.py`` (RoPE passed in as ``custom_pos_emb``, built with its module's ``build_batch_2d_rope``);
    2: the Instruct ``modeling_hunyuan_image_3.py`` (RoPE built inside from ``rope_image_info``).
    """
    params = inspect.signature(model.forward).parameters
    module = sys.modules[type(model).__module__]
    if "custom_pos_emb" in params:
        if not callable(getattr(module, "build_batch_2d_rope", None)):
            raise TypeError(f"{type(model).__name__}.forward takes custom_pos_emb but its module has no "
                            "build_batch_2d_rope to build it")
        return 1
    if "rope_image_info" in params:
        return 2
    raise TypeError(f"{type(model).__name__}.forward takes neither custom_pos_emb (HunyuanImage-3 generation 1) "
                    "nor rope_image_info (generation 2)")


#: The module config.json's ``auto_map`` names for each generation's model class (its modeling file's stem).
MODELING_MODULES = {1: "hunyuan", 2: "modeling_hunyuan_image_3"}


def remote_code_generation(config: dict[str, Any]) -> int | None:
    """Which HunyuanImage-3 generation a checkpoint's config.json points at, read from the module its ``auto_map``
    names for ``AutoModelForCausalLM`` (``hunyuan`` -> 1, ``modeling_hunyuan_image_3`` -> 2); None otherwise.
    Nothing is imported: a stack that cannot import the code can still name it."""
    target = str((config.get("auto_map") or {}).get("AutoModelForCausalLM", ""))
    module = target.rsplit("--", 1)[-1].rpartition(".")[0]
    return next((gen for gen, name in MODELING_MODULES.items() if name == module), None)


def remote_code_name(config: dict[str, Any]) -> str:
    """What a checkpoint's remote code is, for messages: the HunyuanImage-3 generation its auto_map names."""
    generation = remote_code_generation(config)
    if generation is None:
        return "the checkpoint's remote code"
    return f"HunyuanImage-3 generation {generation} ({MODELING_MODULES[generation]}.py)"


class UpstreamBackend:
    """HunyuanImage-3 remote-code contract: ``HunyuanStaticCache``, per-row 2-D writes, gather at position_ids.

    Drives both generations through upstream's own ``prepare_inputs_for_generation`` /
    ``_update_model_kwargs_for_generation``; the generation only decides how RoPE reaches the model
    (``rope_kwargs``). Text-only rows: no image spans.
    """

    layout = "per-row slots (position_ids = KV write index)"

    def __init__(self, model: Any, name: str = "upstream", cache_cls: type | None = None) -> None:
        self.model = model
        self.name = name
        self.generation = upstream_generation(model)
        self._module = sys.modules[type(model).__module__]
        self.cache_cls = cache_cls or getattr(self._module, "HunyuanStaticCache", None)
        if self.cache_cls is None:
            raise TypeError(f"{type(model).__name__}'s module defines no HunyuanStaticCache; pass cache_cls")
        self.pad_id = int(model.config.pad_id)
        self.vocab_size = int(model.config.vocab_size)
        self.kv_heads = int(model.config.num_key_value_heads)
        self.head_dim = int(model.config.attention_head_dim)

    # ------------------------------------------------------------------ cache and RoPE
    def new_cache(self, batch_size: int, max_cache_len: int, dynamic: bool) -> Any:
        return self.cache_cls(config=self.model.config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                              dtype=self.model.dtype, dynamic=dynamic)

    def rope_kwargs(self, batch_size: int, seq_len: int, device: torch.device) -> dict[str, Any]:
        """How this generation receives RoPE for ``batch_size`` text-only rows of up to ``seq_len`` positions:
        generation 1 gets ``custom_pos_emb`` built by its own module; generation 2 gets one (empty)
        ``rope_image_info`` entry per row (``None`` would build a single table, which only works at B=1)."""
        if self.generation == 1:
            cos, sin = self._module.build_batch_2d_rope(
                seq_len=seq_len, n_elem=self.head_dim, image_infos=[[] for _ in range(batch_size)], device=device,
                base=self.model.config.rope_theta)
            return {"custom_pos_emb": (cos, sin)}
        return {"rope_image_info": [[] for _ in range(batch_size)]}

    def _tokenizer_output(self, real_pos: torch.Tensor) -> SimpleNamespace:
        """What upstream's hooks and mask builders read from ``tokenizer_output`` for text-only rows: ``real_pos``
        (the first decode position) and every image-slice list either generation's builder reads, empty per row
        (generation 1 reads ``joint_image_slices`` and ``gen_image_slices``; generation 2's
        ``image_processor.prepare_full_attn_slices`` reads ``vae_image_slices``, ``vit_image_slices`` and
        ``joint_image_slices``, every choice of its ``cond_image_type``, plus ``gen_image_slices``)."""
        rows = real_pos.shape[0]
        return SimpleNamespace(real_pos=real_pos, **{name: [[] for _ in range(rows)] for name in IMAGE_SLICE_FIELDS})

    def _as_generate_sets(self) -> None:
        """Set on the model what upstream's own ``generate`` sets before it drives the hooks, since the harness
        drives prepare/forward/update itself: generation 2's ``forward`` passes ``self.post_token_len`` on, which
        only ``generate`` assigns (the length after the last ``<img>`` token: None, as text-only rows have none).
        ``generate`` also enters a CUDA autocast for gen_text; the harness does not (module docstring)."""
        if self.generation == 2:
            self.model.post_token_len = None

    def model_kwargs(self, real_pos: torch.Tensor, width: int, cache: Any, rope_len: int) -> dict[str, Any]:
        """The model kwargs upstream's ``generate`` hands its hooks for text-only rows right-padded to ``width``:
        prefill ``position_ids = arange(width)``, the cache, ``mode="gen_text"``, ``tokenizer_output`` and this
        generation's RoPE over ``rope_len`` positions; the generate-time model state is set first."""
        self._as_generate_sets()
        rows, device = real_pos.shape[0], real_pos.device
        return {"position_ids": torch.arange(width, device=device)[None].expand(rows, -1),
                "past_key_values": cache, "mode": "gen_text",
                "tokenizer_output": self._tokenizer_output(real_pos.reshape(rows, 1)),
                **self.rope_kwargs(rows, rope_len, device)}

    def generation_mask(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The bool ``[B, 1, L, L]`` mask upstream's ``_prepare_attention_mask_for_generation`` builds from
        ``kwargs`` (it reads ``kwargs["tokenizer_output"]``), on the inputs' device (generation 1 builds it on
        the CPU)."""
        mask = getattr(self.model, compat.GENERATE_MASK_BUILDER)(input_ids, self.model.generation_config, kwargs)
        return mask.to(input_ids.device)

    def _step(self, input_ids: torch.Tensor, kwargs: dict[str, Any],
              mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]:
        """One forward through upstream's own hooks; ``mask`` replaces what the kwargs carry. Returns the logits
        and upstream's updated kwargs, its cache entry renamed to what its prepare step reads (compat)."""
        inputs = self.model.prepare_inputs_for_generation(input_ids, **kwargs)
        inputs["attention_mask"] = mask
        outputs = self.model(**inputs)
        updated = self.model._update_model_kwargs_for_generation(outputs, kwargs)
        return outputs.logits, compat.remote_code_kwargs(updated)

    # ------------------------------------------------------------------ batched loop hooks
    def begin(self, state: ARState) -> None:
        batch = state.batch
        kwargs = self.model_kwargs(state.real_pos, batch.width, state.cache, state.max_cache_len)
        state.extra["model_kwargs"] = {**kwargs, "attention_mask": batch.attention_mask,
                                       "position_ids": batch.position_ids}

    def _forward(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        logits, state.extra["model_kwargs"] = self._step(state.input_ids, state.extra["model_kwargs"], mask)
        return logits

    def prefill_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):  # upstream trims to row 0's last position + 1
            return int(state.batch.position_ids[0, -1]) + 1
        return state.key_slots()

    def prefill(self, state: ARState, mask: torch.Tensor) -> torch.Tensor:
        return self._forward(state, mask)

    def decode_write_slots(self, state: ARState) -> torch.Tensor:
        return state.extra["model_kwargs"]["position_ids"][:, 0]

    def decode_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):
            return int(state.extra["model_kwargs"]["position_ids"][0, -1]) + 1
        return state.key_slots()

    def decode(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        return self._forward(state, mask)

    def key_valid(self, state: ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        """Row i's slots ``[0, real_pos_i + generated_i)``: a slot's offset past its row's prompt, below the count.
        ``generated [..., B]`` -> ``[..., B, key_length]`` (leading dimensions: several steps' counts at once)."""
        def offsets() -> torch.Tensor:
            slots = torch.arange(key_length, device=generated.device)
            return slots[None] - state.real_pos.to(generated.device)[:, None]

        return _per_rollout(state, "key_offsets", offsets, key_length) < generated[..., None]

    def token_columns(self, state: ARState) -> torch.Tensor:
        """Step k's token goes to column ``real_pos_i + k`` of row i (views made once per rollout)."""
        columns = state.extra.get("row_token_columns")
        if columns is None:
            steps = torch.arange(state.max_new_tokens, device=state.real_pos.device)
            columns = state.extra["row_token_columns"] = (steps[:, None] + state.real_pos).unbind(0)
        return columns[state.step_idx]

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        return torch.arange(real_pos + generated)

    # ------------------------------------------------------------------ stock and replay
    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        """Upstream's own generation at B=1 on the unpadded prompt: the cache upstream builds for gen_text
        (dynamic), the mask its ``_prepare_attention_mask_for_generation`` builds (``generate`` accepts no 4-D
        mask), its prepare/update hooks each step (so its decode steps run unmasked), greedy argmax appended,
        as ``GenerationMixin._sample`` does. No harness seam runs."""
        length, device = int(prompt.numel()), prompt.device
        total = length + max_new_tokens
        cache = self.new_cache(1, total, dynamic=True)
        input_ids = prompt[None]
        kwargs = self.model_kwargs(torch.tensor([length], device=device), length, cache, total)
        kwargs["attention_mask"] = self.generation_mask(input_ids, kwargs)
        stops = _stops(eos, device)
        tokens, steps = [], []
        while True:
            logits, kwargs = self._step(input_ids, kwargs, kwargs.get("attention_mask"))
            steps.append(logits[0, -1])
            token = logits[0, -1].argmax()
            tokens.append(token)
            if len(tokens) == max_new_tokens or bool(torch.isin(token, stops)):
                break
            input_ids = torch.cat([input_ids, token.reshape(1, 1)], dim=-1)
        fed = len(tokens) - 1  # the last sampled token is never fed back
        return StockRun(tokens=torch.stack(tokens), logits=torch.stack(steps).float(),
                        kv=_stack_kv(cache, 0, torch.arange(length + fed)))

    def stock_padded(self, prompt: torch.Tensor, tokens: torch.Tensor, width: int, max_cache_len: int,
                     rows: int = 1, row: int = 0) -> torch.Tensor:
        """Teacher-forced stock logits ``[N, V]`` of one prompt right-padded to ``width`` in a static cache of
        ``max_cache_len`` slots (the batch's): upstream's own hooks and mask builder, the prefill mask's key axis
        padded with False to the cache length, prefill logits read at the last real column, each decode step
        under a mask admitting the row's own slots ``[0, real_pos + k]``. Only padding and the longer key axis
        differ from ``stock_generate``: the legitimate rounding a bf16 policy must allow. With ``rows`` > 1 the
        prompt fills every row of a ``rows``-row batch (one uniform batch, which upstream's own hooks handle) and
        ``row``'s logits come back: the batch shape the fast path runs, without its code. No harness loop runs."""
        length, count, device = int(prompt.numel()), int(tokens.numel()), prompt.device
        _check_row(rows, row)
        buf = torch.full((rows, max(width, length + count)), self.pad_id, dtype=torch.long, device=device)
        buf[:, :length] = prompt
        kwargs = self.model_kwargs(torch.full((rows,), length, device=device), width,
                                   self.new_cache(rows, max_cache_len, dynamic=False), max_cache_len)
        causal = self.generation_mask(buf[:, :width], kwargs)
        mask = torch.zeros(rows, 1, width, max_cache_len, dtype=torch.bool, device=device)
        mask[..., :width] = causal
        logits, kwargs = self._step(buf[:, :width], kwargs, mask)
        steps = [logits[row, length - 1]]
        slots = torch.arange(max_cache_len, device=device)
        for k in range(count - 1):
            buf[:, length + k] = tokens[k]  # upstream re-reads the input at position_ids = real_pos + k
            logits, kwargs = self._step(buf, kwargs, (slots <= length + k)[None, None, None].expand(rows, 1, 1, -1))
            steps.append(logits[row, -1])
        return torch.stack(steps).float()

    def stock_prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's prefill of equal-length unpadded rows ``ids [B, L]`` into a static cache exactly L long
        (what gen_image does): logits ``[B, L, V]`` and KV ``[B, layers, 2, H, L, hd]``. No harness seam runs."""
        bsz, length = ids.shape
        cache = self.new_cache(bsz, length, dynamic=False)
        kwargs = self.model_kwargs(torch.full((bsz,), length, device=ids.device), length, cache, length)
        out = self.model(input_ids=ids, attention_mask=self.generation_mask(ids, kwargs),
                         position_ids=kwargs["position_ids"], past_key_values=cache, mode="gen_text",
                         **self.rope_kwargs(bsz, length, ids.device))
        kv = torch.stack([_stack_kv(cache, i, torch.arange(length)) for i in range(bsz)])
        return out.logits.float().cpu(), kv.float().cpu()

    def full_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One unpadded, cache-free forward over ``ids [T]`` -> logits ``[T, V]``."""
        length = int(ids.numel())
        kwargs = self.model_kwargs(torch.tensor([length], device=ids.device), length, None, length)
        out = self.model(input_ids=ids[None], attention_mask=self.generation_mask(ids[None], kwargs),
                         position_ids=kwargs["position_ids"], past_key_values=None, mode="gen_text",
                         **self.rope_kwargs(1, length, ids.device))
        return out.logits[0]


class TransformersBackend:
    """A transformers causal LM over its own ``StaticCache`` with the hole layout (docs/contracts.md, ar)."""

    layout = "shared slots with per-row holes [real_pos_i, Lmax)"

    def __init__(self, model: Any, name: str) -> None:
        self.model = model
        self.name = name
        config = model.config
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self.vocab_size = int(config.vocab_size)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self._cache_kw = compat.forward_cache_kwarg(model.forward)
        self._writes_slots = compat.takes_write_slots(model.forward)

    def new_cache(self, batch_size: int, max_cache_len: int, dynamic: bool) -> Any:
        from transformers import DynamicCache, StaticCache

        if dynamic:
            return DynamicCache(config=self.model.config)
        return StaticCache(config=self.model.config, max_cache_len=max_cache_len)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
             cache: Any, slots: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        if slots is not None:
            kwargs.update(compat.write_slot_kwargs(self.model.forward, slots))
        return self.model(input_ids=ids, attention_mask=model_mask(self.model, mask), position_ids=positions,
                          use_cache=cache is not None, **kwargs).logits

    def begin(self, state: ARState) -> None:
        return None

    def prefill_key_length(self, state: ARState) -> int:
        return state.batch.width if ar_cache.is_dynamic(state.cache) else state.key_slots()

    def prefill(self, state: ARState, mask: torch.Tensor) -> torch.Tensor:
        slots = torch.arange(state.batch.width, device=state.batch.input_ids.device)
        return self._run(state.batch.input_ids, mask, state.batch.position_ids, state.cache, slots)

    def decode_write_slots(self, state: ARState) -> torch.Tensor:
        slot = state.batch.width + state.step_idx - 1
        return torch.full((state.batch.batch_size,), slot, dtype=torch.long, device=state.real_pos.device)

    def decode_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):
            return state.batch.width + state.step_idx
        return state.key_slots()

    def decode(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        """Decode step k feeds the token buffer's column ``W + k - 1`` at RoPE position ``real_pos_i + k - 1``."""
        ids, positions, slots = shared_column_inputs(state, lambda: state.real_pos, self._writes_slots)
        return self._run(ids, mask, positions, state.cache, slots)

    def key_valid(self, state: ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        """Each row's prompt keys, then its own generated tokens' shared slots ``[Lmax, Lmax + generated_i)``: one
        comparison of the counts with each slot's rank (prompt keys rank below any count, holes above all).
        ``generated [..., B]`` -> ``[..., B, key_length]`` (leading dimensions: several steps' counts at once)."""
        def ranks() -> torch.Tensor:
            slots = torch.arange(key_length, device=generated.device)
            width, never = state.batch.width, torch.iinfo(torch.long).max
            generated_rank = torch.where(slots < width, never, slots - width)  # a hole unless a prompt key
            return torch.where(slots < state.real_pos.to(generated.device)[:, None], -1, generated_rank)

        return _per_rollout(state, "key_ranks", ranks, key_length) < generated[..., None]

    def token_columns(self, state: ARState) -> torch.Tensor:
        return shared_token_columns(state)

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        """The prompt's slots then the generated tokens' (a CPU index, moved by callers), built from one list."""
        return torch.tensor([*range(real_pos), *range(width, width + generated)], dtype=torch.long)

    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        """The model alone at B=1 on the unpadded prompt: its default DynamicCache, no mask, no position_ids
        (what ``generate`` does per step; tests/ar/test_transformers.py pins the two together)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        stops = _stops(eos, prompt.device)
        logits = self._run(prompt[None], None, None, cache)[0, -1]
        tokens, steps = [], [logits]
        while True:
            token = logits.argmax()
            tokens.append(token)
            if len(tokens) == max_new_tokens or bool(torch.isin(token, stops)):
                break
            logits = self._run(token.reshape(1, 1), None, None, cache)[0, -1]
            steps.append(logits)
        fed = len(tokens) - 1
        return StockRun(tokens=torch.stack(tokens), logits=torch.stack(steps).float(),
                        kv=_stack_kv(cache, 0, torch.arange(prompt.numel() + fed)))

    def stock_padded(self, prompt: torch.Tensor, tokens: torch.Tensor, width: int, max_cache_len: int,
                     rows: int = 1, row: int = 0) -> torch.Tensor:
        """Teacher-forced logits ``[N, V]`` of one prompt right-padded to ``width`` in the model's own static cache
        of ``max_cache_len`` slots, hole layout (token k at slot ``width + k``, RoPE position ``real_pos + k``),
        every step masked to the row's own keys. Only padding and the longer key axis differ from
        ``stock_generate``; with ``rows`` > 1 the prompt fills every row of a uniform ``rows``-row batch and
        ``row``'s logits come back (the fast path's batch shape, without its code). No harness loop runs."""
        from transformers import StaticCache

        length, count, device = int(prompt.numel()), int(tokens.numel()), prompt.device
        _check_row(rows, row)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device=device)
        ids[:, :length] = prompt
        cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len)
        slots = torch.arange(max_cache_len, device=device)
        positions = torch.arange(width, device=device)[:, None]
        prefill = ((slots[None] <= positions) & (slots[None] < length))[None, None].expand(rows, 1, -1, -1)
        logits = self._run(ids, prefill, torch.arange(width, device=device)[None].expand(rows, -1), cache,
                           torch.arange(width, device=device))
        steps = [logits[row, length - 1]]
        for k in range(count - 1):
            valid = (slots < length) | ((slots >= width) & (slots <= width + k))
            logits = self._run(tokens[k].reshape(1, 1).expand(rows, 1), valid[None, None, None].expand(rows, 1, 1, -1),
                               torch.full((rows, 1), length + k, device=device), cache,
                               torch.tensor([width + k], device=device))
            steps.append(logits[row, -1])
        return torch.stack(steps).float()

    def stock_prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own prefill of equal-length unpadded rows ``ids [B, L]`` (default cache, no mask):
        logits ``[B, L, V]`` and KV ``[B, layers, 2, H, L, hd]``. No harness seam runs."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        logits = self._run(ids, None, None, cache).float()
        kv = torch.stack([_stack_kv(cache, i, torch.arange(ids.shape[1])) for i in range(ids.shape[0])])
        return logits.cpu(), kv.float().cpu()

    def full_forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._run(ids[None], None, None, None)[0]
