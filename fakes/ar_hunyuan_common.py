"""A contract-faithful fake of the HunyuanImage-3 upstream text path (remote code), CPU-sized.

It keeps upstream's names and the behaviours seed 001 found load-bearing, so one harness adapter drives
either this fake or the real ``modeling_hunyuan_image_3``:

- ``HunyuanStaticCache`` subclasses transformers' ``StaticCache`` with a ``dynamic`` flag; a 2-D
  ``cache_position`` writes row by row (index-copy: duplicates, last write wins); when dynamic it then asserts the
  batch is 1 (seed 002's crash) and returns KV trimmed to row 0's last position + 1; when static it returns all
  ``max_cache_len`` slots, unwritten zeros included.
- ``position_ids`` is both the RoPE row index (tables gathered per row) and the KV write index.
- decode steps carry no attention mask (``_update_model_kwargs_for_generation`` drops it), the next input is
  re-read with ``input_ids.gather(1, position_ids)`` and ``generate`` reads logits at the last column.
- zero pad embedding, GQA, a dense SwiGLU MLP or a per-token top-k MoE that never drops tokens.

Only ``mode="gen_text"`` exists here; image spans, VAE and ViT are out of scope.

Like upstream, the model is a transformers ``PreTrainedModel`` (``HunyuanImage3PreTrainedModel`` base, ``config_class``,
``base_model_prefix = ""``, ``_no_split_modules``) so ``save_pretrained`` / ``from_pretrained`` round-trip it. The
module imports only torch, transformers, the standard library and ``harness.compat`` (installed with the project;
it bridges transformers 4.x/5.x): ``fixtures/ar_checkpoint.py`` copies it into a checkpoint directory as
``modeling_hunyuan_image_3.py`` and loads it back as remote code (trust_remote_code=True).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, StaticCache

from harness import compat

__all__ = [
    "GenerateOutput",
    "HunyuanImage3Config",
    "HunyuanImage3ForCausalMM",
    "HunyuanImage3PreTrainedModel",
    "HunyuanStaticCache",
    "build_rope_table",
]


class HunyuanImage3Config(compat.config_base()):
    """The text-path fields of upstream's config (``attention_head_dim``, ``moe_topk``, ``pad_id`` ...)."""

    model_type = "fake_hunyuan_image_3"

    vocab_size: int = 96
    hidden_size: int = 48
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    attention_head_dim: int = 12
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 128
    pad_id: int = 0
    num_experts: int = 1
    moe_topk: int = 1
    use_mixed_mlp_moe: bool = True
    initializer_range: float = 0.02


class HunyuanStaticCache(StaticCache):
    """Upstream's cache: per-row 2-D writes; ``dynamic`` trims the returned KV (and only works at batch 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.dynamic = kwargs.pop("dynamic", False)
        super().__init__(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cache_position = (cache_kwargs or {}).get("cache_position")
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            compat.lazy_init_layer(layer, key_states, value_states)
        k_out, v_out = layer.keys, layer.values
        if cache_position is None:
            k_out.copy_(key_states)
            v_out.copy_(value_states)
            return k_out, v_out
        if cache_position.dim() == 1:
            k_out.index_copy_(2, cache_position, key_states)
            v_out.index_copy_(2, cache_position, value_states)
            if self.dynamic:
                end = int(cache_position[-1]) + 1
                k_out, v_out = k_out[:, :, :end], v_out[:, :, :end]
            return k_out, v_out
        assert cache_position.dim() == 2, f"multiple batch dims not yet {cache_position.shape=}"
        batch_size = cache_position.shape[0]
        assert batch_size == k_out.size(0) == v_out.size(0) == key_states.size(0) == value_states.size(0)
        for i in range(batch_size):
            k_out[i].index_copy_(1, cache_position[i], key_states[i])
            v_out[i].index_copy_(1, cache_position[i], value_states[i])
        if self.dynamic:
            assert len(cache_position) == 1
            end = int(cache_position[0, -1]) + 1
            k_out, v_out = k_out[:, :, :end], v_out[:, :, :end]
        return k_out, v_out


def build_rope_table(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D RoPE tables ``(cos, sin)`` of shape ``[1, seq_len, head_dim]`` (text rows of upstream's 2-D RoPE)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float()[None], emb.sin().float()[None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, S, D] broadcast over heads
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None) -> torch.Tensor:
    """Softmax attention that never reads a masked-out key or value.

    Like a kernel that skips masked blocks, a masked slot contributes nothing even when it holds NaN (torch SDPA
    multiplies 0 by the value and propagates it). A query row with no admitted key returns zeros, as SDPA does.
    ``mask`` is bool ``[B, 1, Q, K]`` (True = may attend) or None (attend every returned slot).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    mask = mask.expand(scores.shape)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    probs = torch.where(mask, probs, 0.0)
    weighted = torch.where(mask[..., None], probs[..., None] * v[:, :, None], 0.0)
    return weighted.sum(dim=-2)


class HunyuanRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HunyuanMLP(nn.Module):
    """SwiGLU with upstream's fused ``gate_and_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(x1 * F.silu(x2))


class HunyuanMoE(nn.Module):
    """Per-token top-k routing (upstream's ``easy_topk``): no capacity, so no token is ever dropped and a
    row's routing never depends on what else is in the batch."""

    def __init__(self, config: HunyuanImage3Config) -> None:
        super().__init__()
        self.moe_topk = config.moe_topk
        self.wg = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=torch.float32)
        self.experts = nn.ModuleList(
            HunyuanMLP(config.hidden_size, config.intermediate_size) for _ in range(config.num_experts))
        self.shared_mlp = (HunyuanMLP(config.hidden_size, config.intermediate_size)
                           if config.use_mixed_mlp_moe else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, hidden = x.shape
        flat = x.reshape(-1, hidden)
        # upstream's HunyuanTopKGate: the router is built in fp32 and routes in its weight's dtype
        gate_in = flat.float() if self.wg.weight.dtype == torch.float32 else flat
        gates = torch.softmax(self.wg(gate_in), dim=-1)
        weight, index = torch.topk(gates, self.moe_topk, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True).clamp_min(1e-8)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weight[token, slot, None])
        out = out.reshape(bsz, seq_len, hidden)
        return out + self.shared_mlp(x) if self.shared_mlp is not None else out


class HunyuanImage3SDPAAttention(nn.Module):
    """GQA attention; RoPE from ``custom_pos_emb``; ``position_ids`` passed to the cache as ``cache_position``."""

    def __init__(self, config: HunyuanImage3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        if self.num_heads % self.num_kv:
            raise ValueError(f"num_attention_heads {self.num_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_kv}")
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                past_key_value: HunyuanStaticCache | None,
                custom_pos_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bsz, q_len, _ = hidden.shape
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * self.head_dim, self.num_kv * self.head_dim, self.num_kv * self.head_dim], dim=-1)
        q = q.reshape(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, k, *custom_pos_emb)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx, {"cache_position": position_ids})
        groups = self.num_heads // self.num_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = masked_attention(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class HunyuanImage3DecoderLayer(nn.Module):
    def __init__(self, config: HunyuanImage3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HunyuanImage3SDPAAttention(config, layer_idx)
        self.post_attention_layernorm = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.num_experts > 1
        self.mlp = HunyuanMoE(config) if moe else HunyuanMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                past_key_value: HunyuanStaticCache | None,
                custom_pos_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), attention_mask, position_ids,
                                         past_key_value, custom_pos_emb)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class CausalMMOutputWithPast:
    logits: torch.Tensor
    past_key_values: HunyuanStaticCache | None = None


@dataclass
class GenerateOutput:
    """The subset of transformers' ``GenerateDecoderOnlyOutput`` the harness reads."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...]
    past_key_values: HunyuanStaticCache | None


class HunyuanImage3PreTrainedModel(PreTrainedModel):
    """Upstream's base class: what transformers reads to save, load and place the model."""

    config_class = HunyuanImage3Config
    base_model_prefix = ""
    _no_split_modules: ClassVar[list[str]] = ["HunyuanImage3DecoderLayer"]
    _skip_keys_device_placement = "past_key_values"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Default init for fresh parameters, and the RoPE tables.

        The tables are non-persistent buffers: ``from_pretrained`` builds the model on the meta device, loads the
        saved weights (marked initialized, so the ``transformers.initialization`` helpers skip them) and leaves the
        buffers as uninitialized memory for this hook to fill, so they must be recomputed here, not only in
        ``__init__``.
        """
        if isinstance(module, HunyuanImage3ForCausalMM):
            cos, sin = build_rope_table(self.config.max_position_embeddings, self.config.attention_head_dim,
                                        self.config.rope_theta)
            compat.init_copy_(module.rope_cos, cos)
            compat.init_copy_(module.rope_sin, sin)
            return
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            compat.init_normal_(module.weight, std)
        elif isinstance(module, nn.Embedding):
            compat.init_normal_(module.weight, std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                compat.init_zeros_(module.weight[module.padding_idx])
        elif isinstance(module, HunyuanRMSNorm):
            compat.init_ones_(module.weight)


class HunyuanImage3ForCausalMM(HunyuanImage3PreTrainedModel, GenerationMixin):
    """The text path of upstream's causal multimodal model."""

    def __init__(self, config: HunyuanImage3Config) -> None:
        super().__init__(config)
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_id)
        self.layers = nn.ModuleList(HunyuanImage3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = build_rope_table(config.max_position_embeddings, config.attention_head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.post_init()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather each row's ``(cos, sin)`` at its own ``position_ids`` -> ``[B, S, head_dim]`` (CachedRoPE)."""
        if int(position_ids.max()) >= self.rope_cos.shape[1]:
            raise ValueError(f"position {int(position_ids.max())} beyond max_position_embeddings "
                             f"{self.rope_cos.shape[1]}")
        bsz, _ = position_ids.shape
        index = position_ids[..., None].expand(-1, -1, self.rope_cos.shape[-1])
        cos = torch.gather(self.rope_cos.expand(bsz, -1, -1), 1, index)
        sin = torch.gather(self.rope_sin.expand(bsz, -1, -1), 1, index)
        return cos.to(self.dtype), sin.to(self.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: HunyuanStaticCache | None = None,
                custom_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None, mode: str = "gen_text",
                **kwargs: Any) -> CausalMMOutputWithPast:
        if mode != "gen_text":
            raise ValueError(f"this fake implements mode='gen_text' only, got mode={mode!r}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        if custom_pos_emb is None:
            custom_pos_emb = self.rope(position_ids)
        hidden = self.wte(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask, position_ids, past_key_values, custom_pos_emb)
        return CausalMMOutputWithPast(self.lm_head(self.ln_f(hidden)).float(), past_key_values)

    # ------------------------------------------------------------------ upstream's generation hooks

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, tokenizer_output=None, **kwargs: Any) -> dict[str, Any]:
        position_ids = kwargs.get("position_ids")
        assert position_ids is not None, "position_ids must be provided in kwargs."
        if input_ids.shape[1] != position_ids.shape[1]:  # decode steps re-read the input at position_ids
            input_ids = torch.gather(input_ids, dim=1, index=position_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "rope_image_info": kwargs["rope_image_info"],
            "mode": kwargs["mode"],
        }

    def _update_model_kwargs_for_generation(self, outputs: CausalMMOutputWithPast, model_kwargs: dict[str, Any],
                                            is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict[str, Any]:
        mode = model_kwargs["mode"]
        updated: dict[str, Any] = {"mode": mode, "rope_image_info": model_kwargs["rope_image_info"],
                                   "past_key_values": outputs.past_key_values}
        if "tokenizer_output" in model_kwargs:  # after prefill: decode starts at each row's first pad index
            updated["position_ids"] = model_kwargs["tokenizer_output"].real_pos.to(self.device)
        else:  # after a decode step; the mask is dropped ("full attention of 1 x seqlen")
            updated["position_ids"] = model_kwargs["position_ids"] + 1
        return updated

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
                 do_sample: bool = False, output_logits: bool = True, return_dict_in_generate: bool = True,
                 pad_token_id: int | None = None, **model_kwargs: Any) -> GenerateOutput:
        """Greedy generation driven the way transformers' ``GenerationMixin._sample`` drives upstream."""
        if do_sample:
            raise ValueError("the fake upstream implements greedy decoding only (do_sample=False)")
        pad = self.config.pad_id if pad_token_id is None else pad_token_id
        stops = torch.tensor([] if eos_token_id is None else
                             [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                             dtype=torch.long, device=input_ids.device)
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        kwargs = dict(model_kwargs)
        logits_out = []
        for _ in range(max_new_tokens):
            inputs = self.prepare_inputs_for_generation(input_ids, **kwargs)
            outputs = self(**inputs)
            next_logits = outputs.logits[:, -1, :]
            logits_out.append(next_logits)
            next_tokens = torch.where(unfinished, next_logits.argmax(dim=-1), pad)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            kwargs = self._update_model_kwargs_for_generation(outputs, kwargs)
            unfinished &= ~torch.isin(next_tokens, stops)
            if not unfinished.any():
                break
        return GenerateOutput(input_ids, tuple(logits_out), kwargs.get("past_key_values"))
