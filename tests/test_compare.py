"""The comparison policies accept what they should and reject what they should, per dtype."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.judging import compare
from harness.judging.compare import close, exact, holds, mismatched, noise_floor, raises, ulp, ulp_distance

pytestmark = pytest.mark.cpu

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _next_up(x: torch.Tensor) -> torch.Tensor:
    """The next representable value above x (x finite, not the largest), by bit arithmetic."""
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype]
    bits = x.view(int_dtype)
    if x.item() == 0:  # -0.0 or +0.0 -> smallest positive subnormal
        return torch.tensor([1], dtype=int_dtype).view(x.dtype)
    step = 1 if x.item() > 0 else -1
    return (bits + step).view(x.dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_ulp_distance_one_step_and_across_zero(dtype):
    one = torch.tensor([1.0], dtype=dtype)
    assert int(ulp_distance(_next_up(one), one)) == 1
    plus_zero, minus_zero = torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype)
    assert int(ulp_distance(plus_zero, minus_zero)) == 0
    tiny = _next_up(plus_zero)
    assert int(ulp_distance(tiny, -tiny)) == 2
    assert int(ulp_distance(tiny, minus_zero)) == 1
    # 1.0 -> 2.0 spans one binade: 2**mantissa_bits steps
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    assert int(ulp_distance(torch.tensor([2.0], dtype=dtype), one)) == 2**mantissa
    assert int(ulp_distance(torch.tensor([-1.0], dtype=dtype), one)) == 2 * int(
        ulp_distance(one, plus_zero))


@pytest.mark.parametrize("dtype", FLOATS)
@given(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=16))
def test_ulp_distance_is_additive_along_the_line(dtype, value):
    a = torch.tensor([value], dtype=dtype)
    b = _next_up(a)
    c = _next_up(b)
    assert int(ulp_distance(a, b)) == 1
    assert int(ulp_distance(a, c)) == 2
    assert int(ulp_distance(c, a)) == 2


def test_ulp_distance_rejects_mixed_dtypes_and_ints():
    with pytest.raises(TypeError, match="one dtype"):
        ulp_distance(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float tensor"):
        ulp_distance(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("dtype", FLOATS)
def test_exact_accepts_identical_rejects_one_ulp(dtype):
    x = torch.linspace(-3, 3, 12, dtype=dtype).reshape(3, 4)
    assert exact().judge(x, x.clone()).passed
    y = x.clone()
    y[1, 2] = _next_up(y[1, 2].reshape(1))[0]
    v = exact().judge(y, x, dims=("row",))
    assert not v.passed
    assert v.metrics["mismatched"] == 1 and v.metrics["max_ulp"] == 1
    assert "row 1, element (2,)" in v.message and "0 allowed" in v.message
    assert v.margin == math.inf


@pytest.mark.parametrize("dtype", FLOATS)
def test_ulp_policy_bounds(dtype):
    x = torch.tensor([1.0, -2.0, 0.0], dtype=dtype)
    y = x.clone()
    y[0] = _next_up(_next_up(x[:1]))[0]
    assert not ulp(1).judge(y, x).passed
    v = ulp(2).judge(y, x)
    assert v.passed and v.margin == pytest.approx(1.0)
    assert ulp(0).judge(x, x.clone()).passed


@pytest.mark.parametrize("dtype", FLOATS)
def test_close_uses_torch_testing_defaults_per_dtype(dtype):
    rtol, atol = compare.default_tolerances(dtype)
    allowed = atol + rtol * 2.0
    b = torch.full((4,), 2.0, dtype=dtype)
    inside = (b.double() + 0.9 * allowed).to(dtype)
    outside = (b.double() + 2.0 * allowed).to(dtype)
    assert close().judge(inside, b).passed
    v = close().judge(outside, b)
    measured = float((outside.double() - 2.0).abs().max()) / allowed
    assert not v.passed and measured > 1 and v.margin == pytest.approx(measured, rel=1e-6)
    policy = close(reason="measured")
    text = policy.describe(dtype)
    assert f"rtol={rtol:g}" in text and "measured" in text


def test_close_explicit_tolerances_and_location():
    b = torch.zeros(2, 3, 4)
    a = b.clone()
    a[1, 2, 3] = 1e-3
    v = close(atol=1e-4, rtol=0).judge(a, b, dims=("row", "step"), labels={"step": [5, 9, 17]})
    assert not v.passed
    assert "row 1, step 17, element (3,)" in v.message
    assert "up to 1.000e-04 allowed" in v.message
    assert v.margin == pytest.approx(10.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("make", [exact, lambda: ulp(1000), lambda: close(atol=1e9, rtol=1e9),
                                  lambda: noise_floor(1.0, k=10.0, floor=1e9)])
def test_non_finite_never_passes(bad, make):
    x = torch.tensor([1.0, bad])
    verdict = make().judge(x, x.clone())
    assert not verdict.passed
    assert verdict.metrics["nonfinite"] == 2


def test_noise_floor_bound_from_control_pair():
    ref = torch.zeros(8, dtype=torch.float64)
    control = ref + 1e-3
    policy = noise_floor((control, ref), k=2.0, floor=1e-6, reason="bf16 control")
    assert policy.bound == pytest.approx(2e-3 + 1e-6)
    assert policy.judge(ref + 1.5e-3, ref).passed
    v = policy.judge(ref + 3e-3, ref)
    assert not v.passed and v.margin == pytest.approx(3e-3 / (2e-3 + 1e-6))
    assert "exceeds 2 x control" in v.message


def test_policy_constructors_reject_nonsense():
    with pytest.raises(ValueError, match="n >= 0"):
        ulp(-1)
    with pytest.raises(ValueError, match="atol"):
        close(atol=-1.0)
    with pytest.raises(ValueError, match="k > 0"):
        noise_floor(1.0, k=0)


def test_shape_mismatch_is_an_error_not_a_verdict():
    with pytest.raises(ValueError, match="shape mismatch"):
        exact().judge(torch.zeros(2), torch.zeros(3))


def test_facts_and_require_and_merge():
    ok = holds(True, "one forward", forwards=1)
    assert ok.passed and ok.margin is None
    bad = ok.require(False, "batch of S*B rows", batch=4)
    assert not bad.passed and "batch of S*B rows" in bad.message and bad.metrics["batch"] == 4
    merged = exact().judge(torch.ones(2), torch.ones(2)).merge(
        close(atol=1.0).judge(torch.ones(2) * 1.5, torch.ones(2)))
    assert merged.passed and merged.margin == pytest.approx(0.5 / 1.0, rel=1e-3)
    assert raises(lambda: int("x"), ValueError, match="invalid literal").passed
    assert not raises(lambda: 1, ValueError).passed
    assert not raises(lambda: {}["k"], ValueError).passed


def test_sha256_depends_on_bytes_dtype_and_shape():
    x = torch.arange(6, dtype=torch.float32)
    assert compare.sha256(x) == compare.sha256(x.clone())
    assert compare.sha256(x) != compare.sha256(x.reshape(2, 3))
    assert compare.sha256(x) != compare.sha256(x.to(torch.float64))
    y = x.clone()
    y[0] = -0.0
    assert compare.sha256(x) != compare.sha256(y)


def test_exact_compares_bit_patterns_not_values():
    """-0.0 == +0.0 and NaN payloads hide under ==; a bitwise policy sees both."""
    plus, minus = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    verdict = exact().judge(minus, plus)
    assert not verdict.passed and verdict.metrics["mismatched"] == 1
    assert "element (0,)" in verdict.message
    assert exact().judge(plus.clone(), plus).passed
    assert mismatched(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16)) == 0


def test_tolerance_bounds_fail_a_loose_or_tight_tolerance():
    base = exact().judge(torch.zeros(2), torch.zeros(2))
    assert base.require_bounded(4e-6, 1e-6, k_min=2, k_max=10).passed
    loose = base.require_bounded(5e-5, 1e-6, k_min=2, k_max=10)
    assert not loose.passed and "too loose" in loose.violated_facts[0]
    tight = base.require_bounded(1e-6, 1e-6, k_min=2, k_max=10)
    assert not tight.passed and "too tight" in tight.violated_facts[0]
