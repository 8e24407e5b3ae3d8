"""``scripts/capture-attention`` on the fake HunyuanImage-3's tiny checkpoint: captures of its own image forward, in
the format ``--capture-dir`` reads, judged by the attention checks; its masks held to the contract's formula; and
the usage errors (the trust flag, a model without an image forward, a directory that is not HunyuanImage-3)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from fixtures.ar_checkpoint import write_gen_image_remote_code, write_hunyuan_remote_code
from fixtures.capture_attention import main
from harness.attention import capture as capture_io
from harness.attention import contract, model_capture
from harness.attention.model_capture import CaptureError, capture_model, check_formula
from harness.inputs.checkpoints import TRUST_FLAG, remote_code_ran
from harness.judging import catalogue, checks
from harness.judging.checks import CheckContext

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_gen_image_remote_code(tmp_path_factory.mktemp("hunyuan_image3_gen_image"))


@pytest.fixture(scope="module")
def captured(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("captures") / "out"
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(out)]) == 0
    return out


def test_the_captures_hold_both_phases_in_the_capture_format(captured):
    capture_io.validate_directory(captured)
    prefill = capture_io.load_capture(capture_io.phase_capture_path(captured, "prefill"))
    denoise = capture_io.load_capture(capture_io.phase_capture_path(captured, "denoise"))
    assert [p.name for p in capture_io.find_captures(captured)] == ["call0_rank0.npz", "call1_rank0.npz"]
    first = contract.detect_layout(prefill.mask)
    later = contract.detect_layout(denoise.mask)
    assert first.phase == "prefill" and len(first.images) == 1  # the conditional image's span, then the generated
    assert later.phase == "denoise" and later.special_len == 1 and later.span == first.span
    assert prefill.heads == 4 and prefill.kv_heads == 2  # the GQA repeat undone: key/value at their own heads


def test_the_attention_checks_judge_the_kernels_on_them(captured):
    catalogue.load()
    ctx = CheckContext(capture_dir=str(captured))
    for phase in ("prefill", "denoise"):
        for check in (f"attention.capture.{phase}.contract", f"attention.{phase}.decomposed.vs_sdpa",
                      f"attention.{phase}.block_padded.vs_sdpa"):
            verdict = checks.run_check(check, ctx)
            assert verdict.passed, verdict


def test_a_mask_off_the_formula_is_named_by_position(checkpoint):
    from harness.inputs.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    recorded = capture_model(model)
    assert [check_formula(item) for item in recorded] == [None, None]
    denoise = recorded[1]
    mask = denoise.capture.mask.clone()
    mask[0, 0, 0, denoise.span[0]] = True  # the timestep row (just before the span) shown the span's first key
    bad = dataclasses.replace(denoise, capture=dataclasses.replace(denoise.capture, mask=mask))
    position = denoise.positions[0]
    assert check_formula(bad) == (f"1 of {mask.shape[2] * mask.shape[3]} pairs differ; first at query row 0 (position "
                                  f"{position}), key {denoise.span[0]}: the model's mask says True, the formula False")


def test_nothing_from_the_directory_runs_without_the_flag(checkpoint, tmp_path, capsys):
    ran = list(remote_code_ran())
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert TRUST_FLAG in capsys.readouterr().err
    assert remote_code_ran() == ran and not (tmp_path / "out").exists()


def test_a_checkpoint_without_an_image_forward_is_a_usage_error(tmp_path, capsys):
    text_only = write_hunyuan_remote_code(tmp_path / "text_only", kind="dense", generation="portable")
    assert main(["--checkpoint", str(text_only), TRUST_FLAG, "--out", str(tmp_path / "out")]) == 2
    assert "no vae['latent_channels']" in capsys.readouterr().err


def test_other_bad_inputs_are_usage_errors(checkpoint, captured, tmp_path, capsys):
    assert main(["--checkpoint", str(captured), TRUST_FLAG, "--out", str(tmp_path / "a")]) == 2
    assert "HunyuanImage3ForCausalMM" in capsys.readouterr().err
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(tmp_path / "b"), "--layers", "3"]) == 2
    assert "--layers [3]: the model has layers 0..0" in capsys.readouterr().err
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(captured)]) == 2
    assert "already holds captures" in capsys.readouterr().err


# ---------------------------------------------------------------------------- capture_model on the model itself


def _tiny(**overrides) -> torch.nn.Module:
    """The fake HunyuanImage-3 with its image parts at ``overrides`` of the tiny config (a fresh, seeded model:
    the shared cached one is never touched)."""
    from fixtures.ar_models import fake_module
    from fixtures.replay_models import HUNYUAN_IMAGE3_CONFIG
    from fixtures.upstream_checkpoint import seeded_init

    module = fake_module("portable")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = module.HunyuanImage3ForCausalMM(module.HunyuanImage3Config(**{**HUNYUAN_IMAGE3_CONFIG, **overrides}))
    seeded_init(model, 0, int(model.config.pad_id))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def three_layers() -> torch.nn.Module:
    return _tiny(num_hidden_layers=3)


class _SdpaLog:
    """torch's SDPA wrapped (beneath capture_model's own spy): a copy of every call's query, key, value and mask as
    SDPA received them, in call order; with ``scramble``, each input is overwritten in place after the call (a
    later write to the model's tensors, which a recorded capture must not see)."""

    def __init__(self, monkeypatch, scramble: bool = False):
        self.calls: list[tuple[torch.Tensor, ...]] = []
        self.scramble = scramble
        self._original = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", self)

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.calls.append(tuple(t.clone() for t in (query, key, value, attn_mask)))
        out = self._original(query, key, value, attn_mask, *args, **kwargs)
        if self.scramble:
            for t in (query, key, value):
                t.add_(100.0)
            q, kv = attn_mask.shape[-2:]  # causal, aligned to the last rows but one: nothing past the image span
            attn_mask.copy_(torch.ones(q, kv, dtype=torch.bool).tril(0 if q == kv else kv - q - 1))
        return out


def _as_sdpa_got(tensor: torch.Tensor) -> torch.Tensor:
    """A capture's ``(B, S, H, D)`` tensor back in SDPA's ``(B, H, S, D)``."""
    return tensor.transpose(1, 2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def _check_against_sdpa(recorded, calls, layers: int, kv_heads: int, heads: int) -> None:
    """Every capture holds exactly what SDPA got at its call (call = step * layers + layer), in the format."""
    for item in recorded:
        query, key, value, mask = calls[item.step * layers + item.layer]
        capture = item.capture
        keys = key.shape[2] if item.step == 0 else item.span[1]
        assert capture.name == capture_io.capture_name(item.step * layers + item.layer)
        for got in (capture.query, capture.key, capture.value):
            assert got.dtype == torch.float32 and got.is_contiguous()
        assert capture.mask.dtype == torch.bool and capture.mask.is_contiguous()
        assert capture.query.shape == (1, query.shape[2], heads, query.shape[3])
        assert _same(_as_sdpa_got(capture.query), query.float())
        # key and value at their key/value heads: SDPA got each head repeated per query-head group
        assert capture.key.shape == (1, keys, kv_heads, key.shape[3]) == capture.value.shape
        group = heads // kv_heads
        assert _same(_as_sdpa_got(capture.key).repeat_interleave(group, dim=1), key[:, :, :keys].float())
        assert _same(_as_sdpa_got(capture.value).repeat_interleave(group, dim=1), value[:, :, :keys].float())
        assert _same(capture.mask, mask[..., :keys])
        assert capture.scale == query.shape[-1] ** -0.5 == 8 ** -0.5  # head_dim ** -0.5


def test_the_captures_are_what_sdpa_got_at_the_chosen_layers(three_layers, monkeypatch):
    log = _SdpaLog(monkeypatch)
    recorded = capture_model(three_layers, layers=[1, 2])
    assert len(log.calls) == 6  # two steps of three layers, all of them run
    assert [(r.step, r.layer, r.capture.name) for r in recorded] == [
        (0, 1, "call1_rank0.npz"), (0, 2, "call2_rank0.npz"), (1, 1, "call4_rank0.npz"), (1, 2, "call5_rank0.npz")]
    assert [r.phase for r in recorded] == ["prefill", "prefill", "denoise", "denoise"]
    _check_against_sdpa(recorded, log.calls, 3, kv_heads=2, heads=4)
    assert [check_formula(item) for item in recorded] == [None] * 4
    later = recorded[2]
    assert later.capture.kv_len == later.span[1] < log.calls[4][1].shape[2]  # the cache cut at the span's end
    assert later.positions == tuple(range(later.span[0] - 1, later.span[1]))  # the timestep token, then the image
    assert all(type(p) is int for item in recorded for p in item.positions)


def test_every_layer_by_default_and_one_layer_alone(three_layers, monkeypatch):
    log = _SdpaLog(monkeypatch)
    every = capture_model(three_layers)
    assert [(r.step, r.layer) for r in every] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [r.capture.name for r in every] == [capture_io.capture_name(n) for n in range(6)]
    _check_against_sdpa(every, log.calls, 3, kv_heads=2, heads=4)
    log.calls.clear()
    only = capture_model(three_layers, layers=[0])
    assert [r.capture.name for r in only] == ["call0_rank0.npz", "call3_rank0.npz"]
    _check_against_sdpa(only, log.calls, 3, kv_heads=2, heads=4)


def test_the_captures_are_copies_later_writes_do_not_reach(three_layers, monkeypatch):
    log = _SdpaLog(monkeypatch, scramble=True)
    recorded = capture_model(three_layers, layers=[0, 2])
    assert len(recorded) == 4
    _check_against_sdpa(recorded, log.calls, 3, kv_heads=2, heads=4)


def test_a_bf16_model_is_captured_in_float32(monkeypatch):
    model = _tiny().to(torch.bfloat16)
    log = _SdpaLog(monkeypatch)
    recorded = capture_model(model)
    assert log.calls[0][0].dtype == torch.bfloat16 and len(recorded) == 2
    _check_against_sdpa(recorded, log.calls, 1, kv_heads=2, heads=4)


def test_capture_attention_runs_at_bf16(checkpoint, tmp_path):
    """The conditional images (a list payload) reach the model in its dtype, as every other input does."""
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(tmp_path / "out"), "--dtype", "bf16"]) == 0


def test_a_model_without_gqa_keeps_every_head(monkeypatch):
    model = _tiny(num_key_value_heads=4)
    log = _SdpaLog(monkeypatch)
    recorded = capture_model(model)
    assert [r.capture.kv_heads for r in recorded] == [4, 4]
    _check_against_sdpa(recorded, log.calls, 1, kv_heads=4, heads=4)


@pytest.mark.parametrize("layers", [[3], [-1], [0, 3], []])
def test_layers_outside_the_model_are_refused(three_layers, layers):
    with pytest.raises(CaptureError, match=r"the model has layers 0\.\.2"):
        capture_model(three_layers, layers=layers)


def test_the_seed_decides_the_capture():
    model = _tiny()

    def arrays(seed=None):
        recorded = capture_model(model) if seed is None else capture_model(model, seed=seed)
        return [(r.capture.query, r.capture.key, r.capture.value, r.capture.mask) for r in recorded]

    default, zero, one = arrays(), arrays(0), arrays(1)  # seed 0 is the default: the same bytes on every run
    for a, b in zip(default, zero, strict=True):
        assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    assert not all(_same(x, y) for a, b in zip(zero, one, strict=True) for x, y in zip(a, b, strict=True))


def _with_mask(model, monkeypatch, edit) -> None:
    """``model``'s own generation mask, as ``edit`` changes it (upstream's mask builder made it otherwise)."""
    build = model._prepare_attention_mask_for_generation
    monkeypatch.setattr(model, "_prepare_attention_mask_for_generation",
                        lambda ids, config, kwargs: edit(build(ids, config, kwargs)), raising=False)


def test_a_later_step_attending_past_the_span_is_refused(monkeypatch):
    model = _tiny()
    span_end = capture_model(model)[1].span[1]

    def admit(mask):  # the image span's last row shown the key just past the span
        mask = mask.clone()
        mask[..., span_end - 1, span_end] = True
        return mask

    _with_mask(model, monkeypatch, admit)
    with pytest.raises(CaptureError, match=rf"call1_rank0\.npz: the later step's mask admits 1 pairs past the image "
                                           rf"span's end {span_end}"):
        capture_model(model)


def test_a_mask_that_is_not_bool_is_refused(monkeypatch):
    model = _tiny()
    _with_mask(model, monkeypatch, lambda mask: torch.zeros(mask.shape).masked_fill(~mask, float("-inf")))
    with pytest.raises(CaptureError, match=r"call0_rank0\.npz: SDPA got a torch\.float32 mask"):
        capture_model(model)


def test_a_later_step_without_a_mask_is_refused_as_such(monkeypatch):
    model = _tiny()
    update = model._update_model_kwargs_for_generation

    def drop_mask(*args, **kwargs):
        updated = update(*args, **kwargs)
        updated["attention_mask"] = None
        return updated

    monkeypatch.setattr(model, "_update_model_kwargs_for_generation", drop_mask, raising=False)
    with pytest.raises(CaptureError, match=r"call1_rank0\.npz: SDPA got no mask"):
        capture_model(model)


def test_key_value_heads_that_are_no_repeat_are_kept():
    from harness.attention.model_capture import _kv_heads

    gen = torch.Generator().manual_seed(0)
    distinct = torch.randn(1, 4, 5, 8, generator=gen)
    assert _same(_kv_heads(distinct, 2), distinct)  # the heads of a group differ: no repeat to undo
    assert _same(_kv_heads(distinct, 3), distinct)  # 4 heads are no whole repeat of 3
    assert _same(_kv_heads(distinct, 4), distinct) and _same(_kv_heads(distinct, 8), distinct)
    repeated = distinct[:, :2].repeat_interleave(2, dim=1)
    assert _same(_kv_heads(repeated, 2), distinct[:, :2])


def test_check_formula_names_query_rows_off_their_positions(checkpoint):
    from harness.inputs.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    denoise = capture_model(model)[1]
    shifted = tuple(p - 1 for p in denoise.positions)
    bad = dataclasses.replace(denoise, positions=shifted)
    q_len, kv_len = denoise.capture.q_len, denoise.capture.kv_len
    assert check_formula(bad) == (f"query rows sit at positions {shifted[0]}..{shifted[-1]} ({q_len} rows), not the "
                                  f"last {q_len} of the {kv_len} keys the formula aligns them to")


def test_check_formula_reads_every_batch_row(checkpoint):
    from harness.inputs.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    prefill = capture_model(model)[0]
    c = prefill.capture
    mask = c.mask.repeat(2, 1, 1, 1)
    two = dataclasses.replace(c, query=c.query.repeat(2, 1, 1, 1), key=c.key.repeat(2, 1, 1, 1),
                              value=c.value.repeat(2, 1, 1, 1), mask=mask)
    assert check_formula(dataclasses.replace(prefill, capture=two)) is None
    mask = mask.clone()
    mask[1, 0, 0, 1] = True  # the second row's first query shown the next key
    bad = dataclasses.replace(prefill, capture=dataclasses.replace(two, mask=mask))
    assert check_formula(bad) == (f"1 of {c.q_len * c.kv_len} pairs differ; first at query row 0 (position 0), key "
                                  f"1: the model's mask says True, the formula False")


def test_an_sdpa_call_in_the_capture_format():
    from harness.attention.model_capture import _to_capture

    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 8, generator=gen).to(torch.bfloat16)  # SDPA's (B, H, S, D), contiguous as such
    key, value = (torch.randn(1, 2, 6, 8, generator=gen).to(torch.bfloat16).repeat_interleave(2, dim=1)
                  for _ in range(2))
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool).tril(2)
    capture = _to_capture((query, key, value, mask), 2, 5, "call7_rank0.npz")
    for got in (capture.query, capture.key, capture.value, capture.mask):
        assert got.is_contiguous()
    assert capture.query.dtype == capture.key.dtype == capture.value.dtype == torch.float32
    assert _same(capture.query, query.transpose(1, 2).float())  # (B, S, H, D)
    assert _same(capture.key, key[:, ::2, :5].transpose(1, 2).float())  # the key/value heads, the first 5 keys
    assert _same(capture.value, value[:, ::2, :5].transpose(1, 2).float())
    assert _same(capture.mask, mask[..., :5]) and capture.scale == 8 ** -0.5 and capture.name == "call7_rank0.npz"
    for bad, what in ((None, "no mask"), (mask.float(), "a torch.float32 mask")):
        with pytest.raises(CaptureError, match=f"call7_rank0.npz: SDPA got {what}"):
            _to_capture((query, key, value, bad), 2, 5, "call7_rank0.npz")


def test_the_steps_are_upstreams_first_step_then_a_later_one(monkeypatch):
    model = _tiny()
    forward, seen = model.forward, []

    @functools.wraps(forward)  # the family reads the forward's parameters
    def logged(*args, **kwargs):
        seen.append((kwargs["first_step"], kwargs["timesteps"].clone(), kwargs["images"].clone()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", logged, raising=False)
    capture_model(model)
    (first, t0, x0), (later, t1, x1) = seen
    assert first is True and later is False
    assert t0.tolist() == [1000.0]  # the sampling schedule's start: the latents are pure noise
    assert 0 < t1.item() < 1000 and x1.shape == x0.shape and not torch.equal(x1, x0)


class _Without:
    """A config as ``config`` is, less the attribute ``name``."""

    def __init__(self, config, name: str):
        self._config, self._name = config, name

    def __getattr__(self, attr):
        if attr == self._name:
            raise AttributeError(attr)
        return getattr(self._config, attr)


def test_a_config_naming_no_key_value_heads_keeps_every_attention_head(monkeypatch):
    """No ``num_key_value_heads``: every attention head is a key/value head, even where the heads' keys and values
    happen to be equal (here made so), so nothing is folded."""
    model = _tiny(num_key_value_heads=4)
    d = model.config.attention_head_dim
    for layer in model.layers:
        weight = layer.self_attn.qkv_proj.weight
        for start in (4 * d, 8 * d):  # the key heads' rows, then the value heads': all as the first head's
            weight[start + d:start + 4 * d] = weight[start:start + d].repeat(3, 1)
    monkeypatch.setattr(model, "config", _Without(model.config, "num_key_value_heads"))
    assert not hasattr(model.config, "num_key_value_heads")
    log = _SdpaLog(monkeypatch)
    recorded = capture_model(model)
    for _, key, value, _ in log.calls:  # the premise: SDPA got every head's keys and values equal
        assert bool((key == key[:, :1]).all()) and bool((value == value[:, :1]).all())
    assert [r.capture.kv_heads for r in recorded] == [4, 4]
    _check_against_sdpa(recorded, log.calls, 1, kv_heads=4, heads=4)


def test_inputs_go_to_the_model_device_and_dtype_list_payloads_and_their_kind_included():
    """Tensors move to the model's device, floating ones in its dtype; a list or tuple payload (the conditional
    images) comes back as the same kind of sequence, each tensor moved; anything else passes through."""
    images = [torch.ones(2, dtype=torch.float32), torch.arange(3)]
    moved = model_capture._on_model(images, torch.device("cpu"), torch.bfloat16)
    assert isinstance(moved, list) and [t.dtype for t in moved] == [torch.bfloat16, torch.int64]
    pair = model_capture._on_model(tuple(images), torch.device("cpu"), torch.float16)
    assert isinstance(pair, tuple) and pair[0].dtype == torch.float16 and torch.equal(pair[1], images[1])
    assert model_capture._on_model("text", torch.device("cpu"), torch.bfloat16) == "text"
