"""The parts both fake HunyuanImage-3 upstream generations share (text path, CPU-sized).

Held to the real remote code by docs/ar-contract.md; each generation's module (``ar_hunyuan_gen1``: ``hunyuan.py``,
``ar_hunyuan_gen2``: the Instruct ``modeling_hunyuan_image_3.py``; ``ar_hunyuan_portable``: the shared contract on
any transformers) adds its RoPE plumbing, its cache's lazy-init call, its MoE routing and its generation hooks.
The fakes are strict: every hook demands what the real one demands (``model_kwargs["tokenizer_output"]`` and the
fields its mask builder reads, ``mode``, the attributes ``generate`` sets), so a harness that stops handing one
over fails on the CPU as it would on the real code. Shared here, as both upstream generations have them:

- ``HunyuanStaticCacheBase``: transformers' ``StaticCache`` with a ``dynamic`` flag; a 2-D ``cache_position``
  writes row by row (index-copy: duplicates, last write wins); when dynamic it then asserts the batch is 1 (seed
  002's crash) and returns KV trimmed to row 0's last position + 1; when static it returns all ``max_cache_len``
  slots, unwritten zeros included.
- ``position_ids`` is both the RoPE row index and the KV write index.
- text-row RoPE tables as upstream's 2-D RoPE builds them (fp32 tables; rotation applied in fp32, then cast).
- attention through torch's ``scaled_dot_product_attention`` over the whole returned key axis, as upstream calls
  it (so bf16 results depend on the key length exactly as upstream's do); ``attention_kernel="eager"`` computes it
  as an eager kernel does (upstream maps ``attn_implementation="eager"`` to its SDPA class; some deployments swap a
  plain softmax in): a -inf masked softmax, under which a query row that admits no key is NaN;
  ``attention_kernel="read_safe"`` swaps in a kernel that never reads a masked slot, for the NaN probes only.
- zero pad embedding, GQA, a dense SwiGLU MLP or a top-k MoE with a shared MLP (``num_experts``, ``moe_topk`` per
  layer or one for all); this base routes every token alone with normalised top-k weights (upstream's
  ``easy_topk``), each generation's subclass reproduces its own deviations (capacity, the single-token path).

The model output is transformers' ``CausalLMOutputWithPast`` with the cache under the field name of the installed
major (``past_key_values`` on 4.x, ``cache`` on 5.x), which is what upstream's kwargs update looks up.
``mode="gen_image"`` (a config with ``vae``) is ``image_forward`` over the parts of ``hunyuan_image_gen``: latents
and timestep tokens scattered into the sequence, the caller's 4-D mask handed to SDPA, the prediction read from the
image tokens; the 2-D RoPE places image tokens on a grid. The VAE and ViT are out of scope. The module imports only
torch, transformers, the standard library and ``harness.inputs.compat`` (installed with the project).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, StaticCache
from transformers.generation.utils import ALL_CACHE_NAMES
from transformers.modeling_outputs import CausalLMOutputWithPast

from harness.inputs import compat

from .hunyuan_image_gen import (
    build_2d_rope_positions,
    image_parts,
    scatter_image_tokens,
    scatter_timestep_tokens,
)
from .hunyuan_image_pipeline import FlowMatchDiscreteScheduler, HunyuanImage3Text2ImagePipeline

__all__ = [
    "IMAGE_SLICE_FIELDS",
    "CausalMMOutputWithPast",
    "HunyuanImage3Config",
    "HunyuanImage3PreTrainedModel",
    "HunyuanMoE",
    "HunyuanStaticCacheBase",
    "HunyuanTextModel",
    "build_batch_2d_rope",
    "carry_cache_and_positions",
    "carry_image_positions",
    "causal_generation_mask",
    "eager_attention",
    "layer_value",
    "masked_attention",
    "rope_table",
    "text_rope_table",
]

KERNELS = ("sdpa", "eager", "read_safe")
#: The per-row image-slice lists a real ``tokenizer_output`` carries (text-only rows: empty lists).
IMAGE_SLICE_FIELDS = ("joint_image_slices", "gen_image_slices", "vae_image_slices", "vit_image_slices")


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
    moe_topk: Any = 1  # one top-k for every layer, or a list with one per layer (the released checkpoints')
    moe_drop_tokens: bool = False  # generation 1: experts drop choices past their capacity (batch-dependent)
    capacity_factor: float = 1.0
    use_mixed_mlp_moe: bool = True
    cond_image_type: str = "vae_vit"  # generation 2's image processor picks the full-attention slices by these
    cond_token_attn_type: str = "full"
    initializer_range: float = 0.02
    attention_kernel: str = "sdpa"
    # mode="gen_image" (``vae`` set): latents of vae["latent_channels"] channels, patch_size x patch_size latent
    # pixels per token, vae_downsample_factor pixels per latent pixel (what upstream's pipeline sizes images by)
    vae: Any = None
    patch_size: int = 1
    patch_embed_hidden_dim: int = 16
    vae_downsample_factor: Any = (16, 16)


class HunyuanStaticCacheBase(StaticCache):
    """Upstream's cache: per-row 2-D writes; ``dynamic`` trims the returned KV (and only works at batch 1).
    Each generation's subclass makes its own ``lazy_initialization`` call (``_lazy_init``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.dynamic = kwargs.pop("dynamic", False)
        super().__init__(*args, **kwargs)

    def _lazy_init(self, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cache_position = (cache_kwargs or {}).get("cache_position")
        layer = self.layers[layer_idx]
        if getattr(layer, "keys", None) is None:
            self._lazy_init(layer, key_states, value_states)
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


def text_rope_table(seq_len: int, head_dim: int, base: float,
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin) [seq_len, head_dim]`` in fp32 for a text-only row of upstream's 2-D RoPE: both axes at the
    token index, so pair k rotates by ``t * base^(-2k/d)`` (upstream computes theta and angles in fp32)."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be divisible by 4 for the 2-D RoPE, got {head_dim}")
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = (torch.arange(seq_len, device=device)[:, None] * theta[None, :]).repeat(1, 2)
    return torch.cos(angles), torch.sin(angles)


def rope_table(seq_len: int, head_dim: int, base: float, image_infos: list | None,
               device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin) [seq_len, head_dim]`` of upstream's 2-D RoPE for one row whose images sit at ``image_infos``
    (``[(slice, (h, w)), ...]``): pair ``2k`` rotates by the token's y, pair ``2k + 1`` by its x
    (``build_2d_rope_positions``). A text-only row is ``text_rope_table``."""
    if not image_infos:
        return text_rope_table(seq_len, head_dim, base, device)
    if head_dim % 4:
        raise ValueError(f"head_dim must be divisible by 4 for the 2-D RoPE, got {head_dim}")
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = build_2d_rope_positions(seq_len, image_infos).to(device)  # [seq_len, 2] (y, x)
    angles = (positions[:, None, :] * theta.reshape(1, head_dim // 4, 2)).reshape(seq_len, head_dim // 2)
    angles = angles.repeat(1, 2)
    return torch.cos(angles), torch.sin(angles)


def build_batch_2d_rope(seq_len: int, n_elem: int, image_infos: list | None = None,
                        device: torch.device | None = None, base: float = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's batched builder: one table per entry of ``image_infos`` (``None`` -> one text-only table), stacked
    to ``[len, seq_len, n_elem]``."""
    infos = [None] if image_infos is None else list(image_infos)
    tables = [rope_table(seq_len, n_elem, base, info, device) for info in infos]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def causal_generation_mask(inputs_tensor: torch.Tensor, row_slices: list[list[slice]],
                           device: torch.device | None = None) -> torch.Tensor:
    """What upstream's ``_prepare_attention_mask_for_generation`` builds: bool ``[B, 1, L, L]``, causal, with a
    full-attention block over every slice of ``row_slices[i]`` in row i (one list per row, as the builder reads
    it from ``tokenizer_output``; a missing row is an IndexError, as upstream's)."""
    bsz, seq_len = inputs_tensor.shape
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril().repeat(bsz, 1, 1)
    for row in range(bsz):
        for span in row_slices[row]:
            mask[row, span, span] = True
    return mask[:, None]


def layer_value(value: Any, layer_idx: int) -> Any:
    """A per-layer config value: one value for every layer, or a list with one per layer (upstream's rule)."""
    return value if isinstance(value, int | float) else value[layer_idx]


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


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None = None) -> torch.Tensor:
    """Softmax attention as an eager kernel writes it: -inf on every score the mask forbids, the softmax in fp32,
    then every value weighted. A query row with no admitted key is NaN (the softmax of -inf alone), and a masked
    slot holding NaN still reaches the output (0 x NaN), as in SDPA. ``mask`` is bool ``[B, 1, Q, K]`` (True = may
    attend), an additive float mask (added to the scores, as SDPA takes one) or None."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask if mask.is_floating_point() else scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


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
    """Top-k routing over SwiGLU experts plus the shared MLP. The router is built in fp32 and routes in its weight's
    dtype (upstream's ``HunyuanTopKGate``); each token's top-k weights are normalised to sum to 1 and no choice is
    ever dropped (upstream's ``easy_topk``), so a token's output never depends on what else is in the forward.
    A generation's subclass overrides ``weights`` / ``kept`` to reproduce its own routing."""

    def __init__(self, config: HunyuanImage3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.moe_topk = int(layer_value(config.moe_topk, layer_idx))
        self.num_experts = int(layer_value(config.num_experts, layer_idx))
        self.wg = nn.Linear(config.hidden_size, self.num_experts, bias=False, dtype=torch.float32)
        self.experts = nn.ModuleList(
            HunyuanMLP(config.hidden_size, config.intermediate_size) for _ in range(self.num_experts))
        self.shared_mlp = (HunyuanMLP(config.hidden_size, config.intermediate_size)
                           if config.use_mixed_mlp_moe else None)

    def weights(self, top: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
        """Each choice's weight from its softmax probability ``top [N, k]`` (fp32)."""
        return top / top.sum(dim=-1, keepdim=True).clamp_min(1e-8)

    def kept(self, index: torch.Tensor) -> torch.Tensor:
        """Which choices ``index [N, k]`` their expert takes (bool): all of them."""
        return torch.ones_like(index, dtype=torch.bool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, hidden = x.shape
        flat = x.reshape(-1, hidden)
        gate_in = flat.float() if self.wg.weight.dtype == torch.float32 else flat
        probs = torch.softmax(self.wg(gate_in).float(), dim=-1)
        top, index = torch.topk(probs, self.moe_topk, dim=-1)
        weight = torch.where(self.kept(index), self.weights(top, bsz, seq_len), 0.0).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weight[token, slot, None])
        out = out.reshape(bsz, seq_len, hidden)
        return out + self.shared_mlp(x) if self.shared_mlp is not None else out


class HunyuanImage3SDPAAttention(nn.Module):
    """GQA attention; RoPE ``(cos, sin)`` per row; ``position_ids`` passed to the cache as ``cache_position``."""

    def __init__(self, config: HunyuanImage3Config, layer_idx: int) -> None:
        super().__init__()
        if config.attention_kernel not in KERNELS:
            raise ValueError(f"attention_kernel must be one of {KERNELS}, got {config.attention_kernel!r}")
        self.kernel = config.attention_kernel
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
                past_key_value: HunyuanStaticCacheBase | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, q_len, _ = hidden.shape
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * self.head_dim, self.num_kv * self.head_dim, self.num_kv * self.head_dim], dim=-1)
        q = q.reshape(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, k, cos, sin)
        q, k = q.to(v.dtype), k.to(v.dtype)  # upstream rotates in the tables' fp32, then casts back
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx, {"cache_position": position_ids})
        groups = self.num_heads // self.num_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0)
        elif self.kernel == "eager":
            out = eager_attention(q, k, v, attention_mask)
        else:
            out = masked_attention(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class HunyuanImage3DecoderLayer(nn.Module):
    def __init__(self, config: HunyuanImage3Config, layer_idx: int, moe_class: type[HunyuanMoE]) -> None:
        super().__init__()
        self.input_layernorm = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HunyuanImage3SDPAAttention(config, layer_idx)
        self.post_attention_layernorm = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = layer_value(config.num_experts, layer_idx) > 1
        self.mlp = moe_class(config, layer_idx) if moe else HunyuanMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                past_key_value: HunyuanStaticCacheBase | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), attention_mask, position_ids,
                                         past_key_value, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class HunyuanImage3PreTrainedModel(PreTrainedModel):
    """Upstream's base class: what transformers reads to save, load and place the model."""

    config_class = HunyuanImage3Config
    base_model_prefix = ""
    _no_split_modules: ClassVar[list[str]] = ["HunyuanImage3DecoderLayer"]
    _skip_keys_device_placement = "past_key_values"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Default init for fresh parameters (5.x re-runs this over loaded weights; compat's helpers skip them)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            compat.init_normal_(module.weight, std)
        elif isinstance(module, nn.Embedding):
            compat.init_normal_(module.weight, std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                compat.init_zeros_(module.weight[module.padding_idx])
        elif isinstance(module, HunyuanRMSNorm):
            compat.init_ones_(module.weight)


@dataclass
class CausalMMOutputWithPast(CausalLMOutputWithPast):
    """Upstream's output: the causal LM's, plus the image prediction of ``mode="gen_image"``."""

    diffusion_prediction: torch.Tensor | None = None


class HunyuanTextModel(HunyuanImage3PreTrainedModel):
    """The text path both generations share; each generation's ``forward`` resolves its RoPE, then calls
    ``text_forward`` (or, for ``mode="gen_image"``, ``image_forward``), and its ``moe_class`` routes. The image
    parts exist when the config names a ``vae``."""

    moe_class: ClassVar[type[HunyuanMoE]] = HunyuanMoE
    # how this generation's sampling loop names the timesteps, and whether it keeps feeding input_ids after the
    # first step (generation 1 re-reads them at position_ids; generation 2 passes None)
    gen_image_timestep_arg: ClassVar[str] = "timesteps"
    gen_image_keeps_input_ids: ClassVar[bool] = False

    def __init__(self, config: HunyuanImage3Config) -> None:
        super().__init__(config)
        self.config = config
        self._pipeline: Any = None
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_id)
        self.layers = nn.ModuleList(HunyuanImage3DecoderLayer(config, i, self.moe_class)
                                    for i in range(config.num_hidden_layers))
        self.ln_f = HunyuanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "vae", None):
            for name, module in image_parts(config).items():
                setattr(self, name, module)
        self.post_init()

    @staticmethod
    def _check_inputs(cond: bool, target: str, check_list: list[tuple[str, Any]]) -> None:
        """Upstream's input check, by its name, place (a static method of the model class), signature and message:
        when ``cond`` holds, every named input must be given (an AssertionError naming the first missing one and
        ``target``, the situation that needs it). Frameworks patch this method, to raise their own error or to relax
        a check, so the forward calls it through the class exactly where upstream does, never inline."""
        if cond:
            for name, item in check_list:
                assert item is not None, f"`{name}` should be provided when `{target}`."

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def pipeline(self) -> Any:
        """Upstream's sampling loop around this model, built once, its schedule shifted by the generation config's
        ``flow_shift`` (which upstream reads from the checkpoint's generation config: no default)."""
        if self._pipeline is None:
            scheduler = FlowMatchDiscreteScheduler(shift=self.generation_config.flow_shift, reverse=True,
                                                   solver="euler")
            self._pipeline = HunyuanImage3Text2ImagePipeline(self, scheduler, self.gen_image_timestep_arg,
                                                             self.gen_image_keeps_input_ids)
        return self._pipeline

    def text_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor, past_key_values: HunyuanStaticCacheBase | None,
                     cos: torch.Tensor, sin: torch.Tensor, mode: str) -> CausalLMOutputWithPast:
        if mode != "gen_text":
            raise ValueError(f"this fake implements mode='gen_text' only, got mode={mode!r}")
        hidden = self.wte(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask, position_ids, past_key_values, cos, sin)
        logits = self.lm_head(self.ln_f(hidden)).float()
        return CausalLMOutputWithPast(logits=logits, **{compat.cache_kwarg_name(): past_key_values})

    def image_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, past_key_values: HunyuanStaticCacheBase | None,
                      cos: torch.Tensor, sin: torch.Tensor, *, images: Any, image_mask: torch.Tensor | None,
                      timesteps: Any, timesteps_index: Any, first_step: bool | None, cond_vae_images: Any = None,
                      cond_vae_image_mask: torch.Tensor | None = None, cond_timesteps: Any = None,
                      cond_timesteps_index: Any = None, num_special_tokens: int = 1) -> CausalMMOutputWithPast:
        """One ``mode="gen_image"`` forward, as upstream computes it.

        First step: the whole sequence, ``input_ids`` embedded with the latents' tokens written at ``image_mask``,
        the timestep token at ``timesteps_index`` and the conditional images' tokens and timesteps likewise; the
        prediction reads the ``image_mask`` positions. A later step: ``[timestep token, image tokens]`` only, over
        the prefix the cache holds from the first step; the prediction reads what follows the special tokens. The
        caller's 4-D ``attention_mask`` reaches SDPA unchanged."""
        if not getattr(self.config, "vae", None):
            raise ValueError("this fake has no image parts: its config names no vae (mode='gen_image' needs one)")
        if first_step:
            hidden = scatter_image_tokens(self, self.wte(input_ids), timesteps, images, image_mask)
            if cond_vae_images is not None:
                hidden = scatter_image_tokens(self, hidden, cond_timesteps, cond_vae_images, cond_vae_image_mask)
            hidden = scatter_timestep_tokens(self, hidden, timesteps, timesteps_index)
            if cond_vae_images is not None:
                hidden = scatter_timestep_tokens(self, hidden, cond_timesteps, cond_timesteps_index)
        else:
            tokens, _, _ = self.patch_embed(images, self.time_embed(timesteps))
            special = self.timestep_emb(timesteps).reshape(images.shape[0], -1, self.config.hidden_size)
            hidden = torch.cat([special, tokens], dim=1)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask, position_ids, past_key_values, cos, sin)
        patch = int(self.config.patch_size)
        token_h, token_w = images.shape[-2] // patch, images.shape[-1] // patch
        prediction = self.ragged_final_layer(hidden, image_mask, timesteps, token_h, token_w, first_step,
                                             num_special_tokens)
        return CausalMMOutputWithPast(logits=None, diffusion_prediction=prediction,
                                      **{compat.cache_kwarg_name(): past_key_values})

    def ragged_final_layer(self, hidden: torch.Tensor, image_mask: torch.Tensor | None, timesteps: Any,
                           token_h: int, token_w: int, first_step: bool | None,
                           num_special_tokens: int = 1) -> torch.Tensor:
        """Upstream's method of this name: the prediction read from the image tokens (the ``image_mask`` positions
        at the first step, what follows the special tokens at a later one) through the final layer."""
        if first_step:
            image_out = hidden.masked_select(image_mask.unsqueeze(-1).bool()).reshape(
                -1, token_h * token_w, hidden.shape[-1])
        else:
            image_out = hidden[:, num_special_tokens:]
        return self.final_layer(image_out, self.time_embed_2(timesteps), token_h, token_w)


def carry_cache_and_positions(outputs: Any, model_kwargs: dict[str, Any], updated: dict[str, Any],
                              device: torch.device, timestep_index_key: str = "gen_timestep_scatter_index",
                              ) -> dict[str, Any]:
    """What both generations' ``_update_model_kwargs_for_generation`` carry to the next step, as upstream does:
    the cache under the first ``ALL_CACHE_NAMES`` name the outputs hold (``use_cache`` is dropped), then the
    positions. ``gen_text``: each row's first pad index after the prefill, +1 after a decode step (the mask is
    dropped: "full attention of 1 x seqlen"). ``gen_image`` (``carry_image_positions``): after the first step, the
    timestep token's position then the image positions, with those rows of the mask; unchanged after."""
    for name in ALL_CACHE_NAMES:
        if name in outputs:
            updated["past_key_values" if name in ("past_buckets_states", "mems") else name] = getattr(outputs, name)
            break
    if model_kwargs["mode"] == "gen_image":
        return carry_image_positions(model_kwargs, updated, timestep_index_key)
    if "tokenizer_output" in model_kwargs:
        updated["position_ids"] = model_kwargs["tokenizer_output"].real_pos.to(device)
    else:
        updated["position_ids"] = model_kwargs["position_ids"] + 1
    return updated


def carry_image_positions(model_kwargs: dict[str, Any], updated: dict[str, Any],
                          timestep_index_key: str) -> dict[str, Any]:
    """``gen_image``'s later steps re-query only the timestep token (its position: the last entry of
    ``timestep_index_key``) and the image tokens, over the prefix the cache holds: those positions become
    ``position_ids`` (also the cache's write slots) and the full mask's rows at them the step's mask."""
    if "tokenizer_output" in model_kwargs:  # right after the first step
        image_mask = model_kwargs["image_mask"]
        bsz, seq_len = image_mask.shape
        index = torch.arange(seq_len, device=image_mask.device).unsqueeze(0).repeat(bsz, 1)
        image_positions = index.masked_select(image_mask.bool()).reshape(bsz, -1)
        timestep_positions = index[torch.arange(bsz), model_kwargs[timestep_index_key][:, -1]].unsqueeze(-1)
        positions = torch.cat([timestep_positions, image_positions], dim=1)
        updated["position_ids"] = positions
        updated["attention_mask"] = torch.stack([torch.index_select(mask_i, 1, rows)
                                                 for mask_i, rows in zip(model_kwargs["attention_mask"], positions,
                                                                         strict=True)])
    else:
        updated["position_ids"] = model_kwargs["position_ids"]
        updated["attention_mask"] = model_kwargs["attention_mask"]
    updated["gen_timestep_scatter_index"] = model_kwargs["gen_timestep_scatter_index"]
    return updated
