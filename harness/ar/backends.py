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
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from harness import compat
from harness.ar import cache as ar_cache

if TYPE_CHECKING:
    from harness.ar.loop import ARState

__all__ = ["StockRun", "TransformersBackend", "UpstreamBackend"]


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


def _stops(eos: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(eos), dtype=torch.long, device=device)


class UpstreamBackend:
    """HunyuanImage-3 remote-code contract: ``HunyuanStaticCache``, per-row 2-D writes, gather at position_ids."""

    layout = "per-row slots (position_ids = KV write index)"

    def __init__(self, model: Any, name: str = "upstream", cache_cls: type | None = None) -> None:
        self.model = model
        self.name = name
        module = sys.modules[type(model).__module__]
        self.cache_cls = cache_cls or getattr(module, "HunyuanStaticCache", None)
        if self.cache_cls is None:
            raise TypeError(f"{type(model).__name__}'s module defines no HunyuanStaticCache; pass cache_cls")
        self.pad_id = int(model.config.pad_id)
        self.vocab_size = int(model.config.vocab_size)
        self.kv_heads = int(model.config.num_key_value_heads)
        self.head_dim = int(model.config.attention_head_dim)

    # ------------------------------------------------------------------ cache
    def new_cache(self, batch_size: int, max_cache_len: int, dynamic: bool) -> Any:
        return self.cache_cls(config=self.model.config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                              dtype=self.model.dtype, dynamic=dynamic)

    # ------------------------------------------------------------------ batched loop hooks
    def begin(self, state: ARState) -> None:
        batch = state.batch
        state.extra["model_kwargs"] = {
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "past_key_values": state.cache,
            "mode": "gen_text",
            "rope_image_info": None,
            "tokenizer_output": SimpleNamespace(real_pos=state.real_pos[:, None]),
        }

    def _forward(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        kwargs = state.extra["model_kwargs"]
        inputs = self.model.prepare_inputs_for_generation(state.input_ids, **kwargs)
        inputs["attention_mask"] = mask
        outputs = self.model(**inputs)
        state.extra["model_kwargs"] = self.model._update_model_kwargs_for_generation(outputs, kwargs)
        return outputs.logits

    def prefill_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):  # upstream trims to row 0's last position + 1
            return int(state.batch.position_ids[0, -1]) + 1
        return state.max_cache_len

    def prefill(self, state: ARState, mask: torch.Tensor) -> torch.Tensor:
        return self._forward(state, mask)

    def decode_write_slots(self, state: ARState) -> torch.Tensor:
        return state.extra["model_kwargs"]["position_ids"][:, 0]

    def decode_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):
            return int(state.extra["model_kwargs"]["position_ids"][0, -1]) + 1
        return state.max_cache_len

    def decode(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        return self._forward(state, mask)

    def key_valid(self, state: ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        slots = torch.arange(key_length, device=generated.device)[None]
        return slots < (state.real_pos + generated)[:, None]

    def token_columns(self, state: ARState) -> torch.Tensor:
        return state.real_pos + state.step_idx

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        return torch.arange(real_pos + generated)

    # ------------------------------------------------------------------ stock and replay
    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        """Upstream's own generate at B=1 on the unpadded prompt, with the cache upstream builds for gen_text."""
        length, device = int(prompt.numel()), prompt.device
        cache = self.new_cache(1, length + max_new_tokens, dynamic=True)
        out = self.model.generate(
            prompt[None], attention_mask=torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None],
            position_ids=torch.arange(length, device=device)[None], past_key_values=cache, mode="gen_text",
            rope_image_info=None, tokenizer_output=SimpleNamespace(real_pos=torch.tensor([[length]], device=device)),
            eos_token_id=list(eos),
            max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, length:]
        fed = tokens.numel() - 1  # the last sampled token is never fed back
        return StockRun(tokens=tokens, logits=torch.stack(out.logits)[:, 0].float(),
                        kv=_stack_kv(cache, 0, torch.arange(length + fed)))

    def stock_prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's prefill of equal-length unpadded rows ``ids [B, L]`` into a static cache exactly L long
        (what gen_image does): logits ``[B, L, V]`` and KV ``[B, layers, 2, H, L, hd]``. No harness seam runs."""
        bsz, length = ids.shape
        cache = self.new_cache(bsz, length, dynamic=False)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None].expand(bsz, -1, -1, -1)
        positions = torch.arange(length, device=ids.device)[None].expand(bsz, -1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         mode="gen_text")
        kv = torch.stack([_stack_kv(cache, i, torch.arange(length)) for i in range(bsz)])
        return out.logits.float().cpu(), kv.float().cpu()

    def full_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One unpadded, cache-free forward over ``ids [T]`` -> logits ``[T, V]``."""
        length = int(ids.numel())
        mask = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()[None, None]
        out = self.model(input_ids=ids[None], attention_mask=mask, position_ids=torch.arange(length, device=ids.device)[
            None], past_key_values=None, mode="gen_text")
        return out.logits[0]


class TransformersBackend:
    """A transformers causal LM over its own ``StaticCache`` with the hole layout (DESIGN.md 1.2)."""

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

    def new_cache(self, batch_size: int, max_cache_len: int, dynamic: bool) -> Any:
        from transformers import DynamicCache, StaticCache

        if dynamic:
            return DynamicCache(config=self.model.config)
        return StaticCache(config=self.model.config, max_cache_len=max_cache_len)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
             cache: Any, slots: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {self._cache_kw: cache, **compat.write_slot_kwargs(self.model.forward, slots)}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                          **kwargs).logits

    def begin(self, state: ARState) -> None:
        return None

    def prefill_key_length(self, state: ARState) -> int:
        return state.batch.width if ar_cache.is_dynamic(state.cache) else state.max_cache_len

    def prefill(self, state: ARState, mask: torch.Tensor) -> torch.Tensor:
        slots = torch.arange(state.batch.width, device=state.batch.input_ids.device)
        return self._run(state.batch.input_ids, mask, state.batch.position_ids, state.cache, slots)

    def decode_write_slots(self, state: ARState) -> torch.Tensor:
        slot = state.batch.width + state.step_idx - 1
        return torch.full((state.batch.batch_size,), slot, dtype=torch.long, device=state.real_pos.device)

    def decode_key_length(self, state: ARState) -> int:
        if ar_cache.is_dynamic(state.cache):
            return state.batch.width + state.step_idx
        return state.max_cache_len

    def decode(self, state: ARState, mask: torch.Tensor | None) -> torch.Tensor:
        column = state.batch.width + state.step_idx - 1
        ids = state.input_ids[:, column: column + 1]
        positions = (state.real_pos + state.step_idx - 1)[:, None]
        slots = torch.tensor([column], device=ids.device)
        return self._run(ids, mask, positions, state.cache, slots)

    def key_valid(self, state: ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        slots = torch.arange(key_length, device=generated.device)[None]
        width = state.batch.width
        prompt = slots < state.real_pos[:, None]
        own = (slots >= width) & (slots < width + generated[:, None])
        return prompt | own

    def token_columns(self, state: ARState) -> torch.Tensor:
        return torch.full_like(state.real_pos, state.batch.width + state.step_idx)

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        return torch.cat([torch.arange(real_pos), width + torch.arange(generated)])  # CPU index, moved by callers

    def stock_generate(self, prompt: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]) -> StockRun:
        """The model alone at B=1 on the unpadded prompt: its default DynamicCache, no mask, no position_ids
        (what ``generate`` does per step; parity/test_ar_transformers.py pins the two together)."""
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
