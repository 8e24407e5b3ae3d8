"""``scripts/capture-attention`` on the fake HunyuanImage-3's tiny checkpoint: captures of its own image forward, in
the format ``--capture-dir`` reads, judged by the attention checks; its masks held to the contract's formula; and
the usage errors (the trust flag, a model without an image forward, a directory that is not HunyuanImage-3)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

from fixtures.ar_checkpoint import write_gen_image_remote_code, write_hunyuan_remote_code
from fixtures.capture_attention import main
from harness.attention import capture as capture_io
from harness.attention import contract, model_capture, rows
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
    """Two rows laid out differently, each row's layout recorded beside it: its spans are where its own mask has
    them, and a later step's row keeps its own keys, ending at its image span."""
    capture_io.validate_directory(captured)
    prefill = capture_io.load_capture(capture_io.phase_capture_path(captured, "prefill"))
    denoise = capture_io.load_capture(capture_io.phase_capture_path(captured, "denoise"))
    assert [p.name for p in capture_io.find_captures(captured)] == ["call0_rank0.npz", "call1_rank0.npz"]
    assert prefill.recorded and denoise.recorded and prefill.query.shape[0] == denoise.query.shape[0] == 2
    assert torch.equal(prefill.spans, denoise.spans) and not torch.equal(prefill.spans[0], prefill.spans[1])
    for first, later in zip(rows.capture_rows(prefill), rows.capture_rows(denoise), strict=True):
        assert first.layout.phase == "prefill" and len(first.layout.images) == 1  # the conditional image, then ours
        assert first.spans == contract.detect_spans(prefill.mask[first.row, 0])  # recorded where the mask has them
        assert later.layout.phase == "denoise" and later.layout.special_len == 1 and later.layout.span == \
            first.layout.span
        assert later.capture.kv_len == later.spans[-1][1] and later.past_keys == 0
        assert first.capture.mask.is_contiguous() and later.capture.mask.is_contiguous()  # cut to its own keys
    assert prefill.heads == 4 and prefill.kv_heads == 2  # the GQA repeat undone: key/value at their own heads


def test_the_attention_checks_judge_the_kernels_on_them(captured):
    catalogue.load()
    ctx = CheckContext(capture_dir=str(captured))
    for phase in ("prefill", "denoise"):
        for check in (f"attention.capture.{phase}.contract", f"attention.{phase}.decomposed.vs_sdpa",
                      f"attention.{phase}.block_padded.vs_sdpa"):
            verdict = checks.run_check(check, ctx)
            assert verdict.passed, verdict.describe()


def test_a_mask_off_the_formula_is_named_by_row_and_position(checkpoint):
    from harness.inputs.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    recorded = capture_model(model)
    assert [check_formula(item) for item in recorded] == [None, None]
    denoise = recorded[1]
    start = int(denoise.capture.spans[1, -1, 0])
    mask = denoise.capture.mask.clone()
    mask[1, 0, 0, start] = True  # row 1's timestep row (just before its span) shown the span's first key
    bad = dataclasses.replace(denoise, capture=dataclasses.replace(denoise.capture, mask=mask))
    position, keys = int(denoise.capture.positions[1, 0]), int(denoise.capture.spans[1, -1, 1])
    assert check_formula(bad) == (f"row 1: 1 of {mask.shape[2] * keys} pairs differ; first at query row 0 (position "
                                  f"{position}), key {start}: the model's mask says True, the formula False")


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
        keys = key.shape[2] if item.step == 0 else int(capture.spans[:, -1, 1].max())  # the longest row's span end
        assert capture.name == capture_io.capture_name(item.step * layers + item.layer)
        for got in (capture.query, capture.key, capture.value):
            assert got.dtype == torch.float32 and got.is_contiguous()
        assert capture.mask.dtype == torch.bool and capture.mask.is_contiguous()
        assert capture.query.shape == (model_capture.BATCH, query.shape[2], heads, query.shape[3])
        assert _same(_as_sdpa_got(capture.query), query.float())
        # key and value at their key/value heads: SDPA got each head repeated per query-head group
        assert capture.key.shape == (model_capture.BATCH, keys, kv_heads, key.shape[3]) == capture.value.shape
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
    later = recorded[2].capture
    ends = later.spans[:, -1, 1]
    assert later.kv_len == int(ends.max()) < log.calls[4][1].shape[2]  # the cache cut at the longest row's span end
    for b in range(later.query.shape[0]):  # each row: its timestep token, then its image, at its own positions
        assert later.positions[b].tolist() == list(range(int(later.spans[b, -1, 0]) - 1, int(ends[b])))
    assert later.positions.dtype == later.spans.dtype == torch.int64


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


def test_a_later_step_attending_past_the_span_is_recorded_and_named():
    """A later step whose mask shows a row a key past its own image span is recorded as it is (the capture keeps
    the keys up to the longest row's end) and its formula check names the row and the pairs."""
    model = _tiny()
    capture = capture_model(model)[1].capture
    short = int(capture.spans[:, -1, 1].argmin())  # the row whose span ends first has cached keys past its end
    end = int(capture.spans[short, -1, 1])
    mask = capture.mask.clone()
    mask[short, 0, -1, end] = True  # its image span's last row shown the key just past its span
    bad = model_capture.Recorded(dataclasses.replace(capture, mask=mask), 1, 0)
    assert check_formula(bad) == (f"row {short}: the mask admits 1 pairs past the row's last query position "
                                  f"{end - 1}")


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
    denoise = capture_model(model)[1].capture
    shifted = denoise.positions.clone()
    shifted[0, 0] -= 5  # row 0's timestep token recorded five positions before the rest of its query rows
    bad = model_capture.Recorded(dataclasses.replace(denoise, positions=shifted), 1, 0)
    moved, first, last, q_len = int(shifted[0, 0]), int(shifted[0, 1]), int(shifted[0, -1]), denoise.q_len
    assert check_formula(bad) == (f"row 0: query rows sit at positions [{moved}, {first}..{last}] ({q_len} rows), "
                                  f"not the last {q_len} of the {last + 1} keys the formula aligns them to")


def test_check_formula_reads_every_batch_row_at_its_own_spans(checkpoint):
    """Row 1 judged at its own recorded spans: its mask built from row 0's spans (the first sample's layout used
    for every row) is named by row, query row, position and key."""
    from harness.inputs.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    prefill = capture_model(model)[0].capture
    mask = prefill.mask.clone()
    mask[1] = mask[0]  # row 1 given row 0's mask
    bad = model_capture.Recorded(dataclasses.replace(prefill, mask=mask), 0, 0)
    problem = check_formula(bad)
    assert problem.startswith("row 1: ") and "pairs differ; first at query row" in problem and "row 0" not in problem


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
    assert t0.tolist() == [1000.0] * model_capture.BATCH  # the sampling schedule's start: the latents are pure noise
    assert bool(((t1 > 0) & (t1 < 1000)).all()) and x1.shape == x0.shape and not torch.equal(x1, x0)


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


# ---------------------------------------------------------------------------- every file and row judged


def _run(check: str, directory: Path):
    catalogue.load()
    return checks.run_check(check, CheckContext(capture_dir=str(directory)))


def _copy(captured: Path, target: Path) -> Path:
    target.mkdir()
    for path in capture_io.find_captures(captured):
        (target / path.name).write_bytes(path.read_bytes())
    return target


def _causal(capture: capture_io.Capture, recorded: bool) -> capture_io.Capture:
    """``capture`` with its mask fully causal (every image span lost), its recorded layout kept or dropped."""
    causal = torch.ones(capture.q_len, capture.kv_len, dtype=torch.bool).tril()[None, None]
    layout = {} if recorded else {"positions": None, "spans": None}
    return dataclasses.replace(capture, mask=causal.expand_as(capture.mask).contiguous(), **layout)


@pytest.mark.parametrize("recorded", [False, True], ids=["seed-format", "recorded-layout"])
def test_one_more_capture_whose_mask_lost_its_spans_is_judged_and_named(captured, tmp_path, recorded):
    """Every capture file is judged, not the first of each phase: one more prefill capture, fully causal (its image
    spans lost), fails the contract check and the kernel checks, each naming the file; with its layout recorded the
    contract says which spans it lost, without it that no structured layout reads its mask."""
    directory = _copy(captured, tmp_path / "captures")
    prefill = capture_io.load_capture(directory / "call0_rank0.npz")
    capture_io.save_capture(_causal(prefill, recorded), directory / "call2_rank0.npz")
    capture_io.validate_directory(directory)
    contract_verdict = _run("attention.capture.prefill.contract", directory)
    assert not contract_verdict.passed and contract_verdict.metrics["files"] == 2
    failed = contract_verdict.violated_facts
    assert failed and all(fact.startswith("call2_rank0.npz row ") for fact in failed), failed
    if recorded:
        assert "call2_rank0.npz row 0: its mask is the contract's formula at the spans recorded beside it" in failed[0]
    else:
        assert failed == [f"call2_rank0.npz row {b}: its spans make a structured layout" for b in range(2)]
    kernel = _run("attention.prefill.decomposed.vs_sdpa", directory)
    assert not kernel.passed and kernel.metrics["captures_judged"] == 4  # two files, two rows each
    assert all(fact.startswith("call2_rank0.npz row ") for fact in kernel.violated_facts), kernel.violated_facts
    assert _run("attention.denoise.decomposed.vs_sdpa", directory).passed  # the other phase's files still pass


def test_a_mask_that_lost_only_the_generated_images_span_fails_against_the_recorded_spans(captured, tmp_path):
    """Read back from its own mask, a prefill mask that lost the generated image's span looks like a layout whose
    only image is the conditional one (mismatches 0); judged at the spans the model recorded beside it, it fails."""
    directory = _copy(captured, tmp_path / "captures")
    prefill = capture_io.load_capture(directory / "call0_rank0.npz")
    mask = prefill.mask.clone()
    for b in range(mask.shape[0]):
        a, e = (int(v) for v in prefill.spans[b, -1])
        mask[b, 0, a:e, a:e] = torch.ones(e - a, e - a, dtype=torch.bool).tril()
    lost = dataclasses.replace(prefill, mask=mask)
    unrecorded = rows.capture_rows(dataclasses.replace(lost, positions=None, spans=None))
    assert all(rows.formula_problems(row) == [] and len(row.spans) == 1 for row in unrecorded)  # agrees with itself
    capture_io.save_capture(lost, directory / "call0_rank0.npz")
    verdict = _run("attention.capture.prefill.contract", directory)
    assert not verdict.passed
    assert verdict.violated_facts[0].startswith("call0_rank0.npz row 0: its mask is the contract's formula at the "
                                                "spans recorded beside it")
    # each row that fails keeps its account under its own name; a row that agrees adds none
    assert "the formula" in verdict.metrics["call0_rank0.npz row 0 formula"], verdict.metrics
    clean = _run("attention.capture.prefill.contract", _copy(captured, tmp_path / "clean"))
    assert clean.passed and not [name for name in clean.metrics if name.endswith(" formula")], clean.metrics


def _plant(model, monkeypatch, bug: str) -> None:
    """A batch-dependent bug in the fake upstream: its mask builder laying every row out with the first sample's
    spans, or its cached step putting the timestep token after the image."""
    module = sys.modules[type(model).__module__]
    if bug == "first_sample_spans":
        slices = module.FullAttentionSlices.prepare_full_attn_slices
        monkeypatch.setattr(module.FullAttentionSlices, "prepare_full_attn_slices",
                            lambda self, output, batch_idx, with_gen=True: slices(self, output, 0, with_gen))
        return
    update = model._update_model_kwargs_for_generation

    def timestep_last(outputs, model_kwargs, *args, **kwargs):
        updated = update(outputs, model_kwargs, *args, **kwargs)
        if "tokenizer_output" in model_kwargs:  # right after the first step: the later steps' rows
            order = [*range(1, updated["position_ids"].shape[1]), 0]
            updated["position_ids"] = updated["position_ids"][:, order]
            updated["attention_mask"] = updated["attention_mask"][:, :, order]
        return updated

    monkeypatch.setattr(model, "_update_model_kwargs_for_generation", timestep_last, raising=False)


@pytest.mark.parametrize(("bug", "phase", "found"), [
    ("first_sample_spans", "prefill", "row 1: "),
    ("timestep_after_image", "denoise", "row 0: query rows sit at positions ["),
])
def test_a_batch_dependent_bug_is_caught_by_the_captures_rows(monkeypatch, tmp_path, bug, phase, found):
    """Captures of two rows laid out differently: a mask built from the first sample's spans for every row fails
    row 1 (row 0 is right by luck), a cached step that puts the timestep token after the image fails every row's
    positions; the recorder names it and the capture's contract check names the file and the row."""
    model = _tiny()
    _plant(model, monkeypatch, bug)
    recorded = [item for item in capture_model(model) if item.phase == phase]
    problems = [check_formula(item) for item in recorded]
    assert all(problem and problem.startswith(found) for problem in problems), problems
    out = tmp_path / "captures"
    out.mkdir()
    for item in capture_model(model):
        capture_io.save_capture(item.capture, out / item.capture.name)
    verdict = _run(f"attention.capture.{phase}.contract", out)
    assert not verdict.passed and verdict.violated_facts[0].startswith(f"{recorded[0].capture.name} row "), \
        verdict.violated_facts
