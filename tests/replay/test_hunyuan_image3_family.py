"""The HunyuanImage-3 replay family's own pieces, held to the documented token layout (``RowLayout``: prefix tokens,
each conditional image ``<boi> <timestep> <img>*hw <eoi>``, prompt tokens, the generated image
``<boi> <size> <ratio> <timestep> <img>*hw <eoi>``, right-padded) and to docs/gen-image-contract.md's table of each
generation's argument names.

Generation 1's and 2's fakes need transformers 4; here both generations' forwards are stood in for by small stubs
whose ``forward`` takes exactly the documented names (this module doubles as their code module: it defines the
``build_batch_2d_rope`` and ``HunyuanStaticCache`` the adapter looks up there), beside the portable fake.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import ar_hunyuan_common
from fixtures.replay_models import tiny_hunyuan_image3
from harness.replay.families import hunyuan_image3 as hy
from harness.replay.families.hunyuan_image3 import (
    COND_GRIDS,
    GENERATION_INPUTS,
    HunyuanImage3Adapter,
    ImageForwardError,
    RowLayout,
    SpecialTokens,
    image_forward_generation,
    marked,
    require_image_forward,
    row_layout,
)

pytestmark = pytest.mark.cpu

GEN1_NAMES = {"timestep": "timestep", "index": "gen_timestep_scatter_index", "rope": "custom_pos_emb",
              "cond_timestep": "cond_timestep", "cond_index": "cond_timestep_scatter_index"}
GEN2_NAMES = {"timestep": "timesteps", "index": "timesteps_index", "rope": "rope_image_info",
              "cond_timestep": "cond_timesteps", "cond_index": "cond_timesteps_index"}
COMMON = ("input_ids", "attention_mask", "position_ids", "mode", "first_step", "images", "image_mask",
          "cond_vae_images", "cond_vae_image_mask")


# ------------------------------------------------------------------------------ stand-ins for both generations
build_batch_2d_rope = ar_hunyuan_common.build_batch_2d_rope  # generation 1's caller-built RoPE, from "its module"


class HunyuanStaticCache:
    """Records how the adapter sizes the cache it hands the pipeline."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _config(channels: int = 4, patch: int = 1, vocab: int = 96, **extra) -> SimpleNamespace:
    return SimpleNamespace(vae={"latent_channels": channels}, patch_size=patch, attention_head_dim=8,
                           rope_theta=10000.0, vocab_size=vocab, **extra)


class _Stub(torch.nn.Module):
    dtype = torch.float32

    def __init__(self, config: SimpleNamespace, parts: tuple[str, ...] = ("patch_embed", "final_layer")):
        super().__init__()
        self.config = config
        for part in parts:
            setattr(self, part, torch.nn.Identity())
        self.calls: list[dict] = []

    def _record(self, kwargs: dict) -> dict:
        seen = {name: getattr(self, name, None) for name in ("num_special_tokens", "num_image_tokens",
                                                             "post_token_len")}
        self.calls.append({**kwargs, "generate_sets": seen})
        return {"diffusion_prediction": kwargs["images"] * 2}


class Gen1Stub(_Stub):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                custom_pos_emb=None, mode="gen_text", first_step=None, images=None, image_mask=None, timestep=None,
                gen_timestep_scatter_index=None, cond_vae_images=None, cond_vae_image_mask=None, cond_timestep=None,
                cond_timestep_scatter_index=None, use_cache=None):
        return self._record(dict(locals(), self=None))


class Gen2Stub(_Stub):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                rope_image_info=None, mode="gen_text", first_step=None, images=None, image_mask=None, timesteps=None,
                timesteps_index=None, cond_vae_images=None, cond_vae_image_mask=None, cond_timesteps=None,
                cond_timesteps_index=None, use_cache=None, gen_timestep_scatter_index=None):
        return self._record(dict(locals(), self=None))


def _portable() -> HunyuanImage3Adapter:
    return HunyuanImage3Adapter(tiny_hunyuan_image3())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ the generations' names
def test_each_generations_argument_names_are_the_documented_ones():
    for g, names in ((1, GEN1_NAMES), (2, GEN2_NAMES)):
        assert hy.TIMESTEP_ARG[g] == names["timestep"]
        assert hy.INDEX_FIELD[g] == names["index"]
        assert hy.ROPE_FIELD[g] == names["rope"]
        assert hy.COND_TIMESTEP_ARG[g] == names["cond_timestep"]
        assert hy.COND_INDEX_FIELD[g] == names["cond_index"]
        assert set(GENERATION_INPUTS[g]) == {*COMMON, *names.values()}
    assert set(hy.TIMESTEP_ARG) == set(hy.INDEX_FIELD) == set(hy.ROPE_FIELD) == {1, 2}


@pytest.mark.parametrize(("stub", "generation", "names"), [(Gen1Stub, 1, GEN1_NAMES), (Gen2Stub, 2, GEN2_NAMES)])
def test_the_generation_is_told_from_the_forward(stub, generation, names):
    model = stub(_config())
    assert image_forward_generation(model) == generation
    assert require_image_forward(model) == generation
    adapter = HunyuanImage3Adapter(model)
    assert adapter.generation == generation
    assert adapter.row_fields == ("input_ids", "attention_mask", "image_mask", "cond_vae_image_mask", names["rope"],
                                  names["index"], names["cond_index"])


@pytest.mark.parametrize("present", [("patch_embed",), ("final_layer",), ()])
def test_a_model_missing_patch_embed_or_final_layer_is_refused(present):
    with pytest.raises(ImageForwardError, match="no patch_embed / final_layer"):
        require_image_forward(Gen2Stub(_config(), parts=present))


# ------------------------------------------------------------------------------ special tokens
@pytest.mark.parametrize("vocab", [16, 17, 96])
def test_special_tokens_are_the_top_of_the_vocabulary(vocab):
    special = SpecialTokens.for_vocab(vocab, 3)
    ids = [special.image, special.timestep, special.boi, special.eoi, special.size, special.ratio]
    assert special.pad == 3
    assert len(set(ids)) == 6 and set(ids) == set(range(vocab - 6, vocab))
    assert 1 < special.text_high <= min(ids)  # text ids [1, text_high) never collide with a special one


def test_a_vocabulary_under_16_tokens_is_refused():
    SpecialTokens.for_vocab(16, 0)
    with pytest.raises(ImageForwardError, match="a vocabulary of 15 tokens leaves no room"):
        SpecialTokens.for_vocab(15, 0)


# ------------------------------------------------------------------------------ the row layout
def test_the_documented_capture_layout():
    """docs/gen-image-contract.md: prefill 42 x 42, the conditional image's span [7, 15), the generated one's
    [25, 41), for a 5-token prefix, one 2 x 4 conditional image and the example rows' prompt and grid."""
    layout = row_layout(5, [(2, 4)])
    assert layout.cond_timestep_positions == [6]
    assert layout.cond_spans == [slice(7, 15)]
    assert layout.timestep_position == 24
    assert layout.image_span == slice(25, 41)
    assert layout.length == 42


def _two_conds() -> RowLayout:
    return RowLayout(prefix=2, cond_grids=((2, 3), (1, 2)), prompt=4, grid=(2, 3))


def test_spans_and_timesteps_of_a_hand_laid_row():
    # 0-1 prefix | 2 boi 3 t 4-9 img 10 eoi | 11 boi 12 t 13-14 img 15 eoi | 16-19 prompt |
    # 20 boi 21 size 22 ratio 23 t 24-29 img 30 eoi
    layout = _two_conds()
    assert layout.cond_timestep_positions == [3, 12]
    assert layout.cond_spans == [slice(4, 10), slice(13, 15)]
    assert layout.timestep_position == 23
    assert layout.image_span == slice(24, 30)
    assert layout.length == 31
    assert layout.rope_image_info() == [(slice(4, 10), (2, 3)), (slice(13, 15), (1, 2)), (slice(24, 30), (2, 3))]


def test_a_row_without_conditional_images():
    layout = RowLayout(prefix=3, cond_grids=(), prompt=2, grid=(1, 3))
    assert layout.cond_spans == [] and layout.cond_timestep_positions == []
    assert layout.timestep_position == 8  # 3 prefix, 2 prompt, <boi> <size> <ratio>
    assert layout.image_span == slice(9, 12)
    assert layout.length == 13
    assert layout.rope_image_info() == [(slice(9, 12), (1, 3))]


def test_the_token_ids_at_every_position():
    special = SpecialTokens.for_vocab(40, 7)
    ids = _two_conds().tokens(34, special, _gen(0)).tolist()
    s = special
    expected = {2: s.boi, 3: s.timestep, **dict.fromkeys(range(4, 10), s.image), 10: s.eoi,
                11: s.boi, 12: s.timestep, 13: s.image, 14: s.image, 15: s.eoi,
                20: s.boi, 21: s.size, 22: s.ratio, 23: s.timestep, **dict.fromkeys(range(24, 30), s.image),
                30: s.eoi, 31: s.pad, 32: s.pad, 33: s.pad}
    assert len(ids) == 34
    for position, token in enumerate(ids):
        if position in expected:
            assert token == expected[position], position
        else:  # text: the prefix and the prompt
            assert 1 <= token < s.text_high, position


def test_a_row_as_wide_as_the_batch_has_no_pad():
    special = SpecialTokens.for_vocab(40, 0)
    layout = _two_conds()
    ids = layout.tokens(layout.length, special, _gen(1))
    assert ids[-1] == special.eoi and (ids != special.pad).all()


def test_text_tokens_are_drawn_from_the_whole_text_range():
    special = SpecialTokens.for_vocab(20, 0)
    layout = RowLayout(prefix=600, cond_grids=(), prompt=1, grid=(1, 1))
    ids = layout.tokens(layout.length, special, _gen(2))
    assert set(ids[:600].tolist()) == set(range(1, special.text_high))


def test_the_mask_is_causal_with_full_attention_inside_every_image():
    layout = _two_conds()
    mask = layout.mask(33)
    expected = torch.ones(33, 33, dtype=torch.bool).tril()
    for lo, hi in ((4, 10), (13, 15), (24, 30)):
        expected[lo:hi, lo:hi] = True
    assert torch.equal(mask, expected)


# ------------------------------------------------------------------------------ the example prompts
def test_the_contracts_prompts_have_the_documented_width():
    """docs/gen-image-contract.md rows 6 and 10: the contract's prompts (B = 2, cfg 2, seed 3) make a (4, 1, 43, 43)
    mask."""
    prompts = _portable().example_prompts(2, 2, _gen(3))
    assert tuple(prompts["attention_mask"].shape) == (4, 1, 43, 43)
    assert tuple(prompts["input_ids"].shape) == (4, 43)


def _layouts(prompts, batch: int) -> list[RowLayout]:
    """Each row's layout, its prefix read back from where its first conditional image's ``<boi>`` sits."""
    index = prompts["cond_timesteps_index"] if "cond_timesteps_index" in prompts else prompts[
        "cond_timestep_scatter_index"]
    return [row_layout(int(index[r][0]) - 1, COND_GRIDS[r % batch]) for r in range(index.shape[0])]


@pytest.mark.parametrize(("batch", "cfg"), [(1, 1), (2, 2), (3, 2), (4, 1)])
def test_example_prompts_lay_every_row_out_as_documented(batch, cfg):
    adapter = _portable()
    config = adapter.module.config
    special = SpecialTokens.for_vocab(int(config.vocab_size), int(config.pad_id))
    prompts = adapter.example_prompts(batch, cfg, _gen(batch + cfg))
    layouts = _layouts(prompts, batch)
    rows = batch * cfg
    assert len(layouts) == rows
    width = max(layout.length for layout in layouts)
    assert tuple(prompts["input_ids"].shape) == (rows, width)
    assert prompts["mode"] == "gen_image"
    assert torch.equal(prompts["position_ids"], torch.arange(width)[None].expand(rows, -1))
    for r, layout in enumerate(layouts):
        ids = prompts["input_ids"][r]
        assert torch.equal(prompts["image_mask"][r], marked(width, [layout.image_span]))
        assert torch.equal(prompts["cond_vae_image_mask"][r], marked(width, layout.cond_spans))
        assert torch.equal(prompts["attention_mask"][r, 0], layout.mask(width))
        assert prompts["timesteps_index"][r].tolist() == [layout.timestep_position]
        assert prompts["gen_timestep_scatter_index"][r].tolist() == [layout.timestep_position]
        assert prompts["cond_timesteps_index"][r].tolist() == layout.cond_timestep_positions
        assert prompts["rope_image_info"][r] == layout.rope_image_info()
        t = layout.timestep_position
        assert ids[t - 3:t + 1].tolist() == [special.boi, special.size, special.ratio, special.timestep]
        assert (ids[layout.image_span] == special.image).all() and ids[layout.image_span.stop] == special.eoi
        assert (ids[layout.length:] == special.pad).all()
        (cond,) = layout.cond_spans
        assert ids[cond.start - 2:cond.start].tolist() == [special.boi, special.timestep]
        assert ids[cond.stop] == special.eoi
        # the row's conditional image is its sample's, of the grid its RoPE and span say
        image = prompts["cond_vae_images"][r]
        assert tuple(image.shape) == (1, 4, *COND_GRIDS[r % batch][0])
        assert prompts["rope_image_info"][r][0] == (cond, tuple(image.shape[-2:]))
        assert image is prompts["cond_vae_images"][r % batch]  # the uncond branch repeats the cond one's
    assert torch.equal(prompts["cond_timesteps"], torch.zeros(rows, 1))
    slices = prompts["tokenizer_output"]
    assert slices.gen_image_slices == [[layout.image_span] for layout in layouts]
    assert slices.vae_image_slices == slices.joint_image_slices == [layout.cond_spans for layout in layouts]
    assert slices.vit_image_slices == [[]] * rows


def test_example_rows_are_told_apart():
    prompts = _portable().example_prompts(4, 2, _gen(0))
    prefixes = sorted(int(index[0]) - 1 for index in prompts["cond_timesteps_index"])
    assert prefixes == list(range(1, 9))  # eight rows, eight different system prompts of at most 8 tokens
    for name in ("input_ids", "image_mask", "cond_vae_image_mask", "timesteps_index"):
        rows = [tuple(row.flatten().tolist()) for row in prompts[name]]
        assert len(set(rows)) == 8, name
    assert len({str(info) for info in prompts["rope_image_info"]}) == 8


def test_the_example_conditional_grids_share_one_token_count():
    counts = {h * w for grids in COND_GRIDS for h, w in grids}
    assert counts == {8} and all(len(grids) == 1 for grids in COND_GRIDS)
    assert len({grids for grids in COND_GRIDS[:2]}) == 2  # neighbouring samples differ in shape


def test_example_prompts_refuse_a_cfg_or_batch_they_cannot_serve():
    adapter = _portable()
    assert adapter.example_prompts(4, 1, _gen(0))["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match="example conditions hold 4 samples"):
        adapter.example_prompts(5, 1, _gen(0))
    with pytest.raises(ValueError, match="cfg must be 1"):
        adapter.example_prompts(2, 3, _gen(0))


def test_example_prompts_on_a_model_of_other_channels_pad_and_vocabulary():
    model = Gen2Stub(_config(channels=3, vocab=50, pad_id=5))
    adapter = HunyuanImage3Adapter(model)
    prompts = adapter.example_prompts(2, 2, _gen(4))
    special = SpecialTokens.for_vocab(50, 5)
    layouts = _layouts(prompts, 2)
    assert [tuple(image.shape) for image in prompts["cond_vae_images"]] == [(1, 3, 2, 4), (1, 3, 4, 2)] * 2
    for r, layout in enumerate(layouts):
        ids = prompts["input_ids"][r]
        assert ids[layout.timestep_position] == special.timestep
        assert (ids[layout.length:] == 5).all()
    assert any(layout.length < prompts["input_ids"].shape[1] for layout in layouts)
    cache = prompts["past_key_values"]
    assert cache.kwargs["max_batch_size"] == 4 and cache.kwargs["max_cache_len"] == prompts["input_ids"].shape[1]


def test_a_config_without_pad_id_pads_with_0():
    adapter = HunyuanImage3Adapter(Gen2Stub(_config()))
    prompts = adapter.example_prompts(2, 2, _gen(5))
    layouts = _layouts(prompts, 2)
    short = [(r, layout) for r, layout in enumerate(layouts) if layout.length < prompts["input_ids"].shape[1]]
    assert short
    for r, layout in short:
        assert (prompts["input_ids"][r, layout.length:] == 0).all()


def test_generation_1_prompts_carry_its_own_names_and_caller_built_rope():
    adapter = HunyuanImage3Adapter(Gen1Stub(_config()))
    prompts = adapter.example_prompts(2, 2, _gen(6))
    layouts = _layouts(prompts, 2)
    assert not {"timesteps", "timesteps_index", "cond_timesteps", "cond_timesteps_index",
                "rope_image_info"} & set(prompts)
    assert prompts["gen_timestep_scatter_index"].tolist() == [[layout.timestep_position] for layout in layouts]
    assert prompts["cond_timestep_scatter_index"].tolist() == [layout.cond_timestep_positions for layout in layouts]
    assert torch.equal(prompts["cond_timestep"], torch.zeros(4, 1))
    width = prompts["input_ids"].shape[1]
    cos, sin = build_batch_2d_rope(width, 8, [layout.rope_image_info() for layout in layouts], base=10000.0)
    assert torch.equal(prompts["custom_pos_emb"][0], cos) and torch.equal(prompts["custom_pos_emb"][1], sin)


# ------------------------------------------------------------------------------ conditions and the forward
def test_conditions_from_prompts_hand_over_generation_2s_fields():
    adapter = _portable()
    prompts = adapter.example_prompts(2, 2, _gen(7))
    conditions = adapter.conditions_from_prompts(prompts, 2)
    assert conditions.batch == 2 and conditions.cfg_factor == 2
    width = prompts["input_ids"].shape[1]
    assert torch.equal(conditions.shared["position_ids"], torch.arange(width))
    assert set(conditions.rows) == {"input_ids", "attention_mask", "image_mask", "cond_vae_image_mask",
                                    "timesteps_index", "cond_timesteps_index", "rope_image_info", "cond_vae_images"}
    for name in ("input_ids", "attention_mask", "image_mask", "cond_vae_image_mask", "timesteps_index",
                 "cond_timesteps_index"):
        assert conditions.rows[name] is prompts[name]
    assert conditions.rows["rope_image_info"] == prompts["rope_image_info"]
    assert conditions.rows["cond_vae_images"] == prompts["cond_vae_images"][:2]


def _images(*shapes_and_seeds):
    return [torch.randn(shape, generator=_gen(seed)) for shape, seed in shapes_and_seeds]


def test_an_uncond_branch_of_equal_copies_is_accepted():
    adapter = _portable()
    prompts = adapter.example_prompts(2, 2, _gen(8))
    a, b = prompts["cond_vae_images"][:2]
    prompts["cond_vae_images"] = [a, b, a.clone(), b.clone()]
    conditions = adapter.conditions_from_prompts(prompts, 2)
    assert conditions.rows["cond_vae_images"] == [a, b]


@pytest.mark.parametrize("order", ["swapped", "second", "other", "short"])
def test_an_uncond_branch_not_repeating_the_cond_ones_is_refused(order):
    adapter = _portable()
    prompts = adapter.example_prompts(2, 2, _gen(9))
    a, b = prompts["cond_vae_images"][:2]
    prompts["cond_vae_images"] = {"swapped": [a, b, b, a], "second": [a, b, b, b], "other": [a, b, a, b + 1],
                                  "short": [a, b]}[order]
    with pytest.raises(ValueError, match="must hold one list per row"):
        adapter.conditions_from_prompts(prompts, 2)


def test_conditions_refuse_a_cfg_other_than_1_or_2():
    adapter = _portable()
    prompts = adapter.example_prompts(3, 2, _gen(10))
    with pytest.raises(ValueError, match="cfg must be 1"):
        adapter.conditions_from_prompts(prompts, 3)


def test_prompt_rows_that_do_not_split_into_the_branches_are_refused():
    adapter = _portable()
    prompts = adapter.example_prompts(3, 1, _gen(10))
    with pytest.raises(ValueError, match="3 prompt rows do not split into 2"):
        adapter.conditions_from_prompts(prompts, 2)


def test_same_images():
    a, b = _images(((1, 4, 2, 4), 0), ((1, 4, 4, 2), 1))
    assert hy._same_images([a, b], [a.clone(), b.clone()]) is True
    assert hy._same_images([], []) is True
    assert hy._same_images([a, b], [a, b + 1]) is False
    assert hy._same_images([a], [a, b]) is False
    assert hy._same_images([a, b], [a]) is False
    assert hy._same_images([torch.zeros(1, 4, 2, 4)], [torch.zeros(1, 4, 4, 2)]) is False


def _forward_inputs(adapter: HunyuanImage3Adapter, batch: int = 2, seed: int = 11):
    prompts = adapter.example_prompts(batch, 1, _gen(seed))
    conditions = adapter.conditions_from_prompts(prompts, 1)
    hidden = torch.randn((batch, *adapter.latent_shape), generator=_gen(seed + 1))
    return prompts, conditions, hidden, torch.tensor([500.0, 250.0][:batch], dtype=torch.float64)


@pytest.mark.parametrize(("stub", "names"), [(Gen1Stub, GEN1_NAMES), (Gen2Stub, GEN2_NAMES)])
def test_forward_kwargs_use_the_generations_own_names(stub, names):
    adapter = HunyuanImage3Adapter(stub(_config()))
    prompts, conditions, hidden, timestep = _forward_inputs(adapter)
    kwargs = adapter.forward_kwargs(hidden, timestep, conditions)
    other = GEN2_NAMES if names is GEN1_NAMES else GEN1_NAMES
    assert not {name for key, name in other.items() if key != "index"} & set(kwargs)
    assert kwargs[names["timestep"]] is timestep
    assert kwargs[names["index"]] is prompts[names["index"]]
    assert kwargs["gen_timestep_scatter_index"] is prompts[names["index"]]
    assert kwargs[names["cond_index"]] is prompts[names["cond_index"]]
    cond_t = kwargs[names["cond_timestep"]]
    assert cond_t.dtype == torch.float64 and torch.equal(cond_t, torch.zeros(2, 1, dtype=torch.float64))
    assert kwargs["past_key_values"] is None and kwargs["use_cache"] is False
    assert kwargs["mode"] == "gen_image" and kwargs["first_step"] is True
    assert kwargs["images"] is hidden
    assert kwargs["cond_vae_images"] == prompts["cond_vae_images"]
    for name in ("input_ids", "attention_mask", "image_mask", "cond_vae_image_mask"):
        assert kwargs[name] is prompts[name]
    width = prompts["input_ids"].shape[1]
    assert torch.equal(kwargs["position_ids"], torch.arange(width)[None].expand(2, -1))
    if names is GEN1_NAMES:
        cos, sin = kwargs["custom_pos_emb"]
        assert torch.equal(cos, prompts["custom_pos_emb"][0]) and torch.equal(sin, prompts["custom_pos_emb"][1])
    else:
        assert kwargs["rope_image_info"] == prompts["rope_image_info"]


class Bf16PredictionStub(Gen2Stub):
    def _record(self, kwargs: dict) -> dict:
        return {"diffusion_prediction": super()._record(kwargs)["diffusion_prediction"].bfloat16()}


def test_a_bf16_models_prediction_is_handed_on_in_fp32():
    """Upstream's loop guides and steps on the prediction in fp32, whatever dtype the model predicts in."""
    adapter = HunyuanImage3Adapter(Bf16PredictionStub(_config()))
    _, conditions, hidden, timestep = _forward_inputs(adapter)
    prediction = adapter.forward(hidden, timestep, conditions)
    assert prediction.dtype == torch.float32 and torch.equal(prediction, (hidden * 2).bfloat16().float())


def test_generation_1_rope_rows_stack_cos_and_sin():
    adapter = HunyuanImage3Adapter(Gen1Stub(_config()))
    prompts = adapter.example_prompts(2, 2, _gen(12))
    conditions = adapter.conditions_from_prompts(prompts, 2)
    rope = conditions.rows["custom_pos_emb"]
    cos, sin = prompts["custom_pos_emb"]
    assert tuple(rope.shape) == (4, 2, *cos.shape[1:])
    assert torch.equal(rope[:, 0], cos) and torch.equal(rope[:, 1], sin)


def test_without_conditional_images_the_cond_timesteps_are_empty():
    adapter = HunyuanImage3Adapter(Gen2Stub(_config()))
    _, conditions, hidden, timestep = _forward_inputs(adapter)
    rows = {**conditions.rows, "cond_vae_images": []}
    kwargs = adapter.forward_kwargs(hidden, timestep, SimpleNamespace(rows=rows, shared=conditions.shared))
    assert tuple(kwargs["cond_timesteps"].shape) == (2, 0)


def test_as_generate_sets_what_generation_2_reads():
    adapter = HunyuanImage3Adapter(Gen2Stub(_config()))
    image_mask = torch.zeros(2, 12, dtype=torch.bool)
    image_mask[0, 3:7] = True  # row 0: 4 image tokens, 12 - 7 = 5 tokens after its last <img>
    image_mask[1, 5:9] = True
    adapter.as_generate_sets(image_mask)
    module = adapter.module
    assert (module.num_special_tokens, module.num_image_tokens, module.post_token_len) == (1, 4, 5)


def test_as_generate_sets_on_the_example_layout():
    adapter = HunyuanImage3Adapter(Gen2Stub(_config()))
    prompts = adapter.example_prompts(2, 2, _gen(13))
    layout = _layouts(prompts, 2)[0]
    adapter.as_generate_sets(prompts["image_mask"])
    width = prompts["input_ids"].shape[1]
    assert adapter.module.num_image_tokens == 16
    assert adapter.module.post_token_len == width - layout.image_span.stop  # <eoi> and the row's padding


def test_generation_1_gets_nothing_set():
    model = Gen1Stub(_config())
    HunyuanImage3Adapter(model).as_generate_sets(torch.ones(2, 5, dtype=torch.bool))
    assert not any(hasattr(model, name) for name in ("num_special_tokens", "num_image_tokens", "post_token_len"))


def test_forward_sets_generation_2s_fields_before_the_model_runs():
    model = Gen2Stub(_config())
    adapter = HunyuanImage3Adapter(model)
    prompts, conditions, hidden, timestep = _forward_inputs(adapter)
    out = adapter.forward(hidden, timestep, conditions)
    assert torch.equal(out, hidden * 2)
    (call,) = model.calls
    width = prompts["input_ids"].shape[1]
    stop = int(prompts["image_mask"][0].nonzero().max()) + 1
    assert call["generate_sets"] == {"num_special_tokens": 1, "num_image_tokens": 16,
                                     "post_token_len": width - stop}
    assert call["timesteps"] is timestep and call["use_cache"] is False


def test_latents_the_patch_size_does_not_divide_are_refused():
    model = Gen2Stub(_config(channels=3, patch=2))
    adapter = HunyuanImage3Adapter(model)
    _, conditions, _, timestep = _forward_inputs(adapter)
    fits = torch.randn(2, 3, 8, 8, generator=_gen(14))  # 3 channels, 4 x 4 tokens at patch 2
    assert torch.equal(adapter.forward(fits, timestep, conditions), fits * 2)
    for shape in ((2, 3, 9, 8), (2, 3, 8, 9)):
        with pytest.raises(ValueError, match="do not fit the model's patch size 2"):
            adapter.forward(torch.zeros(shape), timestep, conditions)
    assert len(model.calls) == 1


def test_latents_off_any_rows_image_span_are_refused():
    adapter = _portable()
    hidden = torch.zeros(2, 4, 4, 4)
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[:, 5:21] = True
    adapter.require_image_span(hidden, mask)  # 16 tokens on every row
    mask[1, 20] = False
    with pytest.raises(ValueError, match=r"make 16 image tokens .* image spans hold \[15, 16\] tokens"):
        adapter.require_image_span(hidden, mask)
    with pytest.raises(ValueError, match=r"make 12 image tokens"):
        adapter.require_image_span(torch.zeros(2, 4, 3, 4), mask[:1].expand(2, -1))


def test_the_latent_grid_is_square_at_latent_hw():
    assert _portable().latent_size == (hy.LATENT_HW, hy.LATENT_HW) == (4, 4)
    adapter = HunyuanImage3Adapter(Gen2Stub(_config(channels=3)), latent_hw=6)
    assert adapter.latent_size == (6, 6) and adapter.latent_shape == (3, 6, 6)


@pytest.mark.parametrize("field", ["cond_vae_image_mask", "timesteps_index", "cond_vae_images"])
def test_forward_refuses_a_missing_row_field(field):
    model = Gen2Stub(_config())
    adapter = HunyuanImage3Adapter(model)
    _, conditions, hidden, timestep = _forward_inputs(adapter)
    rows = {name: value for name, value in conditions.rows.items() if name != field}
    with pytest.raises(ValueError, match=f"row field '{field}' is missing"):
        adapter.forward(hidden, timestep, SimpleNamespace(rows=rows, shared=conditions.shared))
    assert model.calls == []


def test_forward_refuses_rows_short_of_the_latents():
    model = Gen2Stub(_config())
    adapter = HunyuanImage3Adapter(model)
    _, conditions, hidden, timestep = _forward_inputs(adapter)
    with pytest.raises(ValueError, match="cond_vae_images"):
        adapter.forward(hidden, timestep, SimpleNamespace(
            rows={**conditions.rows, "cond_vae_images": conditions.rows["cond_vae_images"][:1]},
            shared=conditions.shared))
    assert model.calls == []


def test_forward_refuses_conditions_without_shared_position_ids():
    model = Gen2Stub(_config())
    adapter = HunyuanImage3Adapter(model)
    _, conditions, hidden, timestep = _forward_inputs(adapter)
    with pytest.raises(ValueError, match=r"shared field\(s\) \['position_ids'\] missing"):
        adapter.forward(hidden, timestep, SimpleNamespace(rows=conditions.rows, shared={}))
    assert model.calls == []
