"""The fp32 ar tolerances judged by what they let through, on hand-built rollouts and a stand-in stock prefill.

Each quantity's tolerance is derived from a floor measured on stock code: an error just inside it passes and one
just outside fails, whatever the magnitude of the compared values (no relative slack); the stock noise itself
passes and a bug of K_MAX floors cannot; the floor is read over the vocabulary axis, in the log-probs' own units;
and a policy with no tolerance at all is refused under a floor as too tight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from fixtures import ar_models
from harness.ar import judge
from harness.ar import policies as ar_policies
from harness.ar.loop import Rollout
from harness.judging.compare import exact

pytestmark = pytest.mark.cpu

VOCAB = 5
LOGP_SHIFT = 1e-3  # how far the stand-in's batched prefill moves one logit: a floor far above any fp32 spacing
KV_SHIFT = 2e-3


def _logits(ids: torch.Tensor, gap: float = 3.0) -> torch.Tensor:
    """Per-row logits, the same for a row alone or batched: token t favours vocabulary entry t % VOCAB."""
    logits = torch.zeros(*ids.shape, VOCAB, dtype=torch.float64)
    logits.scatter_(-1, (ids % VOCAB)[..., None], gap)
    return logits


def _stand_in(logits_of: Callable[[torch.Tensor], torch.Tensor] = _logits, kv_sign: float = 1.0,
              kv_scale: float = 1.0, shifts: tuple[float, float] = (LOGP_SHIFT, KV_SHIFT)) -> SimpleNamespace:
    """A backend whose batched stock prefill differs from the prompts alone by ``shifts`` (logit, KV): the
    batch-shape rounding of real GEMMs, made up here with a known size."""

    def stock_prefill(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(ids).float()
        kv = kv_sign * kv_scale * (1.0 + ids.float()[:, None, None, None, :, None].expand(-1, 1, 2, 1, -1, 2) / 10)
        if ids.shape[0] > 1:
            logits = logits.clone()
            logits[0, 0, 0] += shifts[0]
            kv = kv.clone()
            kv[0, 0, 0, 0, 0, 0] += shifts[1]
        return logits, kv

    return SimpleNamespace(pad_id=0, vocab_size=11, name="stand-in", stock_prefill=stock_prefill)


def _floor(**stand_in: object) -> ar_policies.StockPrefillFloor:
    return ar_policies.stock_prefill_floor(_stand_in(**stand_in))


def _recording(stand_in: SimpleNamespace) -> list[torch.Tensor]:
    """The token ids of every stock prefill ``stand_in`` runs from now on, in order."""
    seen, prefill = [], stand_in.stock_prefill

    def recorded(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(ids.clone())
        return prefill(ids)

    stand_in.stock_prefill = recorded
    return seen


def _rollout(magnitude: float) -> Rollout:
    """Two rows, 3 steps, real_pos [3, 2]; log-probs near -magnitude, KV near magnitude (slot 0 included)."""
    tokens = torch.tensor([[5, 6, 7], [5, 6, 7]])
    logp = -magnitude * torch.tensor([[1.0, 1.1, 1.2], [1.3, 1.4, 1.5]])
    kv = tuple(magnitude * (1.0 + torch.arange(4 * slots, dtype=torch.float32).reshape(1, 2, 1, slots, 2) / 7)
               for slots in (4, 3))
    return Rollout(tokens, logp, torch.zeros(2, 3, VOCAB), torch.tensor([3, 3]), torch.tensor([3, 2]), kv)


def _moved(rollout: Rollout, what: str, by: float) -> Rollout:
    """``rollout`` with one element of the judged quantity moved by ``by`` (row 1 for logp and prefill KV)."""
    logp, kv = rollout.logp.clone(), [k.clone() for k in rollout.kv]
    if what == "logp":
        logp[1, 2] += by
    elif what == "prefill_kv":
        kv[1][0, 1, 0, 1, 0] += by  # slot 1 < real_pos 2: inside row 1's prefill
    else:
        kv[0][0, 0, 0, 0, 1] += by  # slot 0 of row 0
    return Rollout(rollout.tokens, logp, rollout.logits, rollout.lengths, rollout.real_pos, tuple(kv))


def _judge(what: str, fast: Rollout, ref: Rollout, policies: ar_policies.ARPolicies):
    return judge.compare_case(what, fast, ref, policies)


@pytest.mark.parametrize("magnitude", [1.0, 100.0])
@pytest.mark.parametrize("what", ["logp", "prefill_kv", "slot0"])
def test_an_fp32_tolerance_passes_an_error_just_inside_it_and_fails_one_just_outside(what: str,
                                                                                       magnitude: float) -> None:
    policies = ar_policies.fp32_policies(_floor())
    ref = _rollout(magnitude)
    tolerance = _judge(what, ref, ref, policies).tolerance
    assert tolerance and tolerance > 0
    inside = _judge(what, _moved(ref, what, 0.98 * tolerance), ref, policies)
    outside = _judge(what, _moved(ref, what, 1.02 * tolerance), ref, policies)
    assert inside.passed, inside.describe()
    assert not outside.passed and outside.margin > 1.0, outside.describe()  # no slack from |values| ~ magnitude
    assert outside.violated_facts == []  # failed on the error, not on a bound of the policy


@pytest.mark.parametrize("what", ["logp", "prefill_kv", "slot0"])
def test_the_fp32_room_is_eight_stock_floors(what: str) -> None:
    """A batched run may differ from B=1 by up to 8 x the stock floor of the same model (the rounding of another
    batch shape, measured on stock code): 7.9 floors pass, 8.1 fail."""
    floor = _floor()
    unit = floor.floor({"logp": "logp", "prefill_kv": "kv", "slot0": "kv"}[what])
    policies, ref = ar_policies.fp32_policies(floor), _rollout(1.0)
    assert _judge(what, _moved(ref, what, 7.9 * unit), ref, policies).passed
    assert not _judge(what, _moved(ref, what, 8.1 * unit), ref, policies).passed


@pytest.mark.parametrize("what", ["logp", "prefill_kv", "slot0"])
def test_the_stock_noise_passes_and_a_bug_of_k_max_floors_fails(what: str) -> None:
    floor = _floor()
    quantity = {"logp": "logp", "prefill_kv": "kv", "slot0": "kv"}[what]
    measured = floor.floor(quantity)
    assert measured >= 0.5 * (LOGP_SHIFT if quantity == "logp" else KV_SHIFT)  # the measurement, not a minimum
    policies = ar_policies.fp32_policies(floor)
    ref = _rollout(1.0)
    assert _judge(what, _moved(ref, what, measured), ref, policies).passed
    assert not _judge(what, _moved(ref, what, ar_policies.K_MAX * measured), ref, policies).passed


def test_the_logp_floor_is_read_over_the_vocabulary_in_log_prob_units() -> None:
    """With no batch-shape rounding the floor is the log-probs' own resolution: it follows their magnitude
    (the largest |log-prob|) and ignores what log-probs ignore (a constant added to every logit of
    one position), which a floor read over any other axis, or from the raw logits, would not."""
    flat = {"shifts": (0.0, 0.0)}
    base = _floor(**flat).floor("logp")
    assert base > 0
    largest = {gap: math.log(math.exp(gap) + VOCAB - 1) for gap in (3.0, 6.0)}  # max |log-prob| at this gap
    assert _floor(logits_of=lambda ids: _logits(ids, gap=6.0), **flat).floor("logp") == pytest.approx(
        base * largest[6.0] / largest[3.0], rel=1e-3)
    shifted = _floor(logits_of=lambda ids: _logits(ids) + 40.0 * torch.arange(ids.shape[1])[None, :, None]
                     + 7.0 * ids[..., None], **flat).floor("logp")
    assert shifted == pytest.approx(base, rel=1e-3)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_kv_floor_follows_the_kv_magnitude_whatever_its_sign(sign: float) -> None:
    flat = {"shifts": (0.0, 0.0), "kv_sign": sign}
    base = _floor(**flat).floor("kv")
    assert base > 0
    assert _floor(kv_scale=2.0, **flat).floor("kv") == pytest.approx(2 * base, rel=0.01)


@pytest.mark.parametrize("what", ["logp", "prefill_kv", "slot0"])
def test_a_policy_with_no_tolerance_is_refused_under_a_floor_as_too_tight(what: str) -> None:
    """A floor of 0.1 leaves [K_MIN, K_MAX] x 0.1 for a tolerance: an exact policy (tolerance 0) sits below it."""
    floor = _floor(shifts=(0.1, 0.1))
    policies = ar_policies.ARPolicies(exact(), exact(), exact(), exact(), floor)
    ref = _rollout(1.0)
    verdict = _judge(what, ref, ref, policies)
    assert not verdict.passed
    assert [fact for fact in verdict.violated_facts if "too tight" in fact], verdict.describe()


def _curve_rollout(steps: int, offset: float = 0.0) -> Rollout:
    logp = -1.0 - torch.arange(2 * steps, dtype=torch.float32).reshape(2, steps) / 10 + offset
    tokens = torch.full((2, steps), 5)
    return Rollout(tokens, logp, torch.zeros(2, steps, VOCAB), torch.tensor([steps, steps]), torch.tensor([3, 2]),
                   (torch.zeros(1, 2, 1, 3 + steps, 2), torch.zeros(1, 2, 1, 2 + steps, 2)))


def test_the_growth_check_judges_six_steps_and_refuses_five() -> None:
    """Thirds of at least two steps each: six steps are the fewest a growth ratio is read from."""
    ref = _curve_rollout(6)
    control = _curve_rollout(6, offset=1e-4).logp
    verdict = judge.judge_growth(_curve_rollout(6, offset=1e-5), ref, control)
    assert verdict.passed, verdict.describe()
    five = _curve_rollout(5)
    with pytest.raises(ValueError, match="needs >= 6 steps, got 5"):
        judge.judge_growth(five, five, five.logp)


def test_the_growth_check_refuses_a_control_of_another_shape_alone() -> None:
    ref = _curve_rollout(6)
    with pytest.raises(ValueError, match="log-prob shapes differ"):
        judge.judge_growth(ref, ref, _curve_rollout(7).logp)


@pytest.mark.parametrize(("measured", "scale"), [(0.0, 0.0), (math.nan, 1.0), (math.inf, 1.0)])
def test_an_fp32_tolerance_needs_a_finite_positive_floor(measured: float, scale: float) -> None:
    """A stock run whose KV is all zeros (no magnitude, no measured rounding) leaves no floor: a tolerance of 0 x
    nothing would pass only bitwise-equal runs by accident, so it is refused, as a non-finite stock run is."""
    floor = ar_policies.StockPrefillFloor(logp=measured, kv=measured, backend="zeros", logp_scale=scale,
                                          kv_scale=scale)
    with pytest.raises(ValueError, match="the stock floor of kv on zeros is .*: the stock run must be finite"):
        ar_policies.fp32_tolerance(floor, "kv")


def test_a_floor_of_exactly_zero_is_refused_and_the_smallest_positive_one_is_not() -> None:
    """A stock run with no magnitude and no measured rounding leaves a floor of 0: any tolerance, 0 included,
    would sit "within" k x 0, so the bound is refused for want of a floor. One step above 0 is a floor."""
    values = torch.tensor([[-1.0, -2.0]])
    passed = exact().judge(values, values)
    zero = ar_policies.StockPrefillFloor(logp=0.0, kv=0.0, backend="zeros", logp_scale=0.0, kv_scale=0.0)
    refused = judge.require_floor_bounds(passed, 0.0, zero, "logp")
    assert not refused.passed
    assert refused.violated_facts == ["stock logp floor measured on zeros (finite, > 0)"]
    tiny = math.nextafter(0.0, 1.0)
    smallest = ar_policies.StockPrefillFloor(logp=tiny, kv=tiny, backend="tiny", logp_scale=0.0, kv_scale=0.0)
    accepted = judge.require_floor_bounds(passed, ar_policies.TOLERANCE_K * tiny, smallest, "kv")
    assert accepted.passed and accepted.violated_facts == []


def test_a_floor_built_without_a_shape_states_the_batch_the_default_measurement_prefills() -> None:
    """``rows`` x ``length`` is the batch a floor was prefilled at: a floor built from the same measurements
    without them states (and describes) the batch ``stock_prefill_floor`` prefills when it is given no shape."""
    stand_in = _stand_in()
    seen = _recording(stand_in)
    measured = ar_policies.stock_prefill_floor(stand_in)
    shapes = [tuple(ids.shape) for ids in seen]
    given = ar_policies.StockPrefillFloor(logp=measured.logp, kv=measured.kv, backend=measured.backend,
                                          logp_scale=measured.logp_scale, kv_scale=measured.kv_scale)
    assert shapes[0] == (given.rows, given.length)  # the batched prefill, ahead of each row alone
    assert given == measured and given.describe() == measured.describe()


def test_a_floor_describes_the_quantity_it_is_asked_for_or_both() -> None:
    """A policy's reason names the floor of its own quantity (slot 0 is KV); with no quantity both are listed."""
    floor = _floor()
    logp = f"logp {floor.stock_floor('logp').describe()}"
    kv = f"KV {floor.stock_floor('kv').describe()}"
    assert floor.describe("logp") == f"stock floor on stand-in: {logp}"
    assert floor.describe("kv") == floor.describe("slot0") == f"stock floor on stand-in: {kv}"
    assert floor.describe() == f"stock floor on stand-in: {logp}; {kv}"


@pytest.mark.parametrize(("rows", "length"), [(0, 6), (4, 0)])
def test_a_prefill_floor_of_an_empty_batch_is_refused_before_the_model_runs(rows, length):
    with pytest.raises(ValueError, match=f"needs rows >= 1 and length >= 1, got {rows} x {length}"):
        ar_policies.stock_prefill_floor(None, rows=rows, length=length)


def test_a_prefill_floor_of_one_token_in_one_row_is_measured():
    floor = ar_policies.stock_prefill_floor(ar_models.backend("fake"), rows=1, length=1)
    assert floor.rows == 1 and floor.length == 1 and math.isfinite(floor.logp)


def test_the_floor_is_measured_where_the_model_lives() -> None:
    """The stock floor runs on the model's own device: its parameters' device, the CPU for none."""
    on_meta = SimpleNamespace(model=torch.nn.Linear(2, 2, device="meta"))
    assert ar_policies.model_device(on_meta) == torch.device("meta")
    for model in (None, torch.nn.ReLU()):
        assert ar_policies.model_device(SimpleNamespace(model=model)) == torch.device("cpu")


@pytest.mark.parametrize("pad_id", [0, 2])
def test_the_prefill_floor_prompts_hold_no_pad_token(pad_id: int) -> None:
    """The floor's batch is unpadded: no prompt token is the pad id, wherever the pad sits in the vocabulary."""
    stand_in = _stand_in()
    stand_in.pad_id, stand_in.vocab_size = pad_id, 3
    seen = _recording(stand_in)
    ar_policies.stock_prefill_floor(stand_in)
    batch = seen[0]
    assert batch.shape == (4, 6) and bool(((batch >= 0) & (batch < 3)).all())
    assert not bool((batch == pad_id).any()) and len(batch.unique()) == 2  # every other token is drawn
    assert torch.equal(torch.cat(seen[1:]), batch)  # each row alone is the batched row
