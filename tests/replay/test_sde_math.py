"""The SDE math and its fp64 oracles at their edges: the dtypes they promise whatever arrives, the
multistep solver's extrapolation and its history, sampling without a generator."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from harness.replay import oracles
from harness.replay.sde import FlowGRPOSDE, MultistepSDE, gaussian_log_prob, sde_step

pytestmark = pytest.mark.cpu

ROWS = 3


def _rows(seed: int, low: float, high: float, *shape: int) -> torch.Tensor:
    """fp32 values drawn in [low, high): their fp32 sums and products round, so fp32 math shows."""
    gen = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand((ROWS, *shape), generator=gen, dtype=torch.float32)


def _shared(values: torch.Tensor) -> torch.Tensor:
    """The first value of ``values`` as a 0-d tensor: one value every row shares."""
    return values.reshape(-1)[0]


SIGMA, SIGMA_NEXT, STD_T = _rows(1, 0.55, 0.95), _rows(2, 0.05, 0.45), _rows(3, 0.3, 0.9)
X, V = _rows(4, -1.0, 1.0, 2, 2), _rows(5, -1.0, 1.0, 2, 2)
SUBSETS = [c for n in range(1, 4) for c in itertools.combinations(range(3), n)]


def _both(fn, per_row: tuple[torch.Tensor, ...], scalar: tuple[int, ...], before=(), after=()):
    """fn on fp32 inputs with the arguments in ``scalar`` as 0-d tensors, and on the same values in fp64,
    expanded per row: an fp64 oracle must give the same bits either way."""
    mixed = [_shared(a) if i in scalar else a for i, a in enumerate(per_row)]
    wide = [(_shared(a).expand_as(a) if i in scalar else a).double() for i, a in enumerate(per_row)]
    got, want = fn(*before, *mixed, *after), fn(*[b.double() for b in before], *wide, *after)
    return torch.broadcast_to(got, want.shape), want


def test_flow_mean_oracle_computes_in_fp64_for_scalar_or_per_row_sigmas():
    for scalar in SUBSETS:
        got, want = _both(oracles.flow_mean64, (SIGMA, SIGMA_NEXT, STD_T), scalar, before=(X, V))
        assert got.dtype == torch.float64 and torch.equal(got, want), scalar


def test_std_oracle_computes_in_fp64_for_scalar_or_per_row_inputs():
    for scalar in SUBSETS:
        got, want = _both(oracles.std64, (STD_T, SIGMA, SIGMA_NEXT), scalar)
        assert got.dtype == torch.float64 and torch.equal(got, want), scalar


def test_flow_mean_oracle_squares_std_t_in_fp64():
    """One hand-checked row: x (1 + s^2/(2 sigma) dt) + v (1 + s^2 (1 - sigma)/(2 sigma)) dt, s = 0.1 (fp32)."""
    s = float(torch.tensor(0.1, dtype=torch.float32))
    dt = 0.25 - 0.75
    want = 2.0 * (1.0 + s * s / 1.5 * dt) + 4.0 * (1.0 + s * s * 0.25 / 1.5) * dt
    got = oracles.flow_mean64(torch.tensor([[2.0]]), torch.tensor([[4.0]]), torch.tensor([0.75]),
                              torch.tensor([0.25]), torch.tensor([0.1]))
    assert got.dtype == torch.float64 and float(got) == pytest.approx(want, rel=1e-15, abs=0)


def test_constant_std_oracle_is_eta_in_fp64():
    got = oracles.constant_std_t64(torch.tensor([0.5, 0.25]), 0.7)
    assert got.dtype == torch.float64 and got.tolist() == [0.7, 0.7]


def test_log_prob_oracle_computes_in_fp64_for_a_shared_sample_mean_or_std():
    """A 0-d mean needs a 0-d std (a per-row std shapes itself to the mean). Row by row, by hand:
    mean over elements of -(p - m)^2 / (2 s^2) - log s - log sqrt(2 pi)."""
    for scalar in ((2,), (1, 2), (0,), (0, 2), (0, 1, 2)):
        got, want = _both(oracles.gaussian_log_prob64, (X, V, STD_T), scalar)
        assert got.dtype == torch.float64 and torch.equal(got, want), scalar
        wide = [(_shared(a).expand_as(a) if i in scalar else a).double() for i, a in enumerate((X, V, STD_T))]
        for row in range(ROWS):
            p, m, s = wide[0][row].flatten().tolist(), wide[1][row].flatten().tolist(), float(wide[2][row])
            terms = [-((a - b) ** 2) / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
                     for a, b in zip(p, m, strict=True)]
            assert float(want[row]) == pytest.approx(sum(terms) / len(terms), rel=1e-12)


def test_cfg_oracle_computes_in_fp64_for_a_shared_branch():
    for scalar in ((0,), (1,)):
        got, want = _both(oracles.cfg_standard64, (X, V), scalar, after=(4.5,))
        assert got.dtype == torch.float64 and torch.equal(got, want), scalar


# ----------------------------------------------------------------------------------- sde.py


def _matches_oracle(x, v, mean, std, prev=None, eta=0.7, sigma=SIGMA, sigma_next=SIGMA_NEXT):
    """The fp32 Flow-GRPO transition (and the log-prob of ``prev``) against the fp64 oracles, to fp32 rounding."""
    std_t = oracles.flow_grpo_std_t64(sigma, 0.9, eta)
    want_std = oracles.std64(std_t, sigma, sigma_next)
    ok = torch.allclose(mean.double(), oracles.flow_mean64(x, v, sigma, sigma_next, std_t), rtol=1e-5, atol=1e-6)
    ok = ok and torch.allclose(std.double(), want_std, rtol=1e-5, atol=0)
    if prev is not None:
        got = gaussian_log_prob(prev, mean, std).double()
        ok = ok and torch.allclose(got, oracles.gaussian_log_prob64(prev, mean, want_std), rtol=1e-5, atol=1e-5)
    return ok


def test_transition_by_hand_and_at_its_edges():
    """Row 0: sigma 0.75 -> 0.25; row 1: sigma 1 -> 0.5, where Flow-GRPO uses s' = sigma_max = 0.9. Hand
    values: std_t = eta sqrt(sigma / (1 - s')), mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2
    (1 - sigma) / (2 sigma)) dt, std = std_t sqrt(-dt), log N(prev; mean, std^2) averaged over the row.
    Equal sigmas are refused; fp64 inputs give the same fp32 results as fp32 ones."""
    x, v, prev = [[2.0, -1.0], [0.5, 1.5]], [[4.0, 0.5], [-2.0, 1.0]], [[1.0, 0.0], [0.25, 2.0]]
    sigma, sigma_next = torch.tensor([0.75, 1.0]), torch.tensor([0.25, 0.5])
    strategy = FlowGRPOSDE(eta=0.7)
    mean, std = strategy.transition(torch.tensor(x), torch.tensor(v), sigma, sigma_next, 0.9)
    log_prob = gaussian_log_prob(torch.tensor(prev), mean, std)
    for row, (sig, nxt, s_prime) in enumerate(((0.75, 0.25, 0.75), (1.0, 0.5, 0.9))):
        std_t, dt = 0.7 * math.sqrt(sig / (1 - s_prime)), nxt - sig
        want_mean = [a * (1 + std_t**2 * dt / (2 * sig)) + b * (1 + std_t**2 * (1 - sig) / (2 * sig)) * dt
                     for a, b in zip(x[row], v[row], strict=True)]
        want_std = std_t * math.sqrt(-dt)
        want_lp = sum(-((p - m) ** 2) / (2 * want_std**2) - math.log(want_std) - 0.5 * math.log(2 * math.pi)
                      for p, m in zip(prev[row], want_mean, strict=True)) / 2
        assert mean[row].tolist() == pytest.approx(want_mean, rel=1e-6)
        assert float(std[row]) == pytest.approx(want_std, rel=1e-6)
        assert float(log_prob[row]) == pytest.approx(want_lp, rel=1e-6)
    wide = (torch.tensor(x).double(), torch.tensor(v).double())
    wide_mean, wide_std = strategy.transition(*wide, sigma, sigma_next, 0.9)
    assert (wide_mean.dtype, wide_std.dtype) == (torch.float32, torch.float32)
    assert torch.equal(wide_mean, mean) and torch.equal(wide_std, std)
    wide_lp = gaussian_log_prob(torch.tensor(prev).double(), mean, std)
    assert wide_lp.dtype == torch.float32 and torch.equal(wide_lp, log_prob)
    with pytest.raises(ValueError, match="an SDE step needs sigma_next < sigma on every row"):
        strategy.transition(torch.tensor(x), torch.tensor(v), sigma, torch.tensor([0.25, 1.0]), 0.9)


def test_transition_and_log_prob_are_fp32_whatever_the_inputs_dtype():
    strategy = FlowGRPOSDE()
    mean, std = strategy.transition(X.double(), V.double(), SIGMA, SIGMA_NEXT, 0.9)
    want_mean, want_std = strategy.transition(X, V, SIGMA, SIGMA_NEXT, 0.9)
    assert (mean.dtype, std.dtype) == (torch.float32, torch.float32)
    assert torch.equal(mean, want_mean) and torch.equal(std, want_std)
    log_prob = gaussian_log_prob(X.double(), mean, std)
    assert log_prob.dtype == torch.float32 and torch.equal(log_prob, gaussian_log_prob(X, mean, std))
    assert _matches_oracle(X, V, mean, std, prev=V)
    with pytest.raises(ValueError, match="an SDE step needs sigma_next < sigma on every row"):
        strategy.transition(X, V, SIGMA, torch.cat([SIGMA_NEXT[:2], SIGMA[2:]]), 0.9)


def test_multistep_drift_extrapolates_the_previous_step_velocity():
    """Adams-Bashforth: 1.5 v_i - 0.5 v_(i-1) when step i-1 ran just before; v alone otherwise."""
    flow = FlowGRPOSDE(eta=0.7)
    solver = MultistepSDE(eta=0.7)
    first = solver.transition(X, V, SIGMA, SIGMA_NEXT, 0.9, step_index=2)
    assert torch.equal(first[0], flow.transition(X, V, SIGMA, SIGMA_NEXT, 0.9)[0])
    assert _matches_oracle(X, V, *first, prev=X)
    v3 = _rows(6, -1.0, 1.0, 2, 2)
    mean, std = solver.transition(X, v3, SIGMA, SIGMA_NEXT, 0.9, step_index=3)
    assert torch.equal(mean, flow.transition(X, 1.5 * v3 - 0.5 * V, SIGMA, SIGMA_NEXT, 0.9)[0])
    assert _matches_oracle(X, 1.5 * v3.double() - 0.5 * V.double(), mean, std, prev=v3)
    skipped, _ = solver.transition(X, v3, SIGMA, SIGMA_NEXT, 0.9, step_index=5)
    assert torch.equal(skipped, flow.transition(X, v3, SIGMA, SIGMA_NEXT, 0.9)[0])


def test_multistep_history_keeps_fp32_velocities():
    """The drift is the fp32 SDE math's: a velocity arriving in fp64 is extrapolated from as fp32."""
    solver, flow = MultistepSDE(eta=0.7), FlowGRPOSDE(eta=0.7)
    x, v3 = _rows(8, -1.0, 1.0, 256), _rows(9, -1.0, 1.0, 256)
    v2 = torch.rand(v3.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2 - 1
    solver.transition(x, v2, SIGMA, SIGMA_NEXT, 0.9, step_index=2)
    assert solver.history[2].dtype == torch.float32
    mean, std = solver.transition(x, v3, SIGMA, SIGMA_NEXT, 0.9, step_index=3)
    assert torch.equal(mean, flow.transition(x, 1.5 * v3 - 0.5 * v2.float(), SIGMA, SIGMA_NEXT, 0.9)[0])
    assert _matches_oracle(x, 1.5 * v3.double() - 0.5 * v2, mean, std, prev=x)


def test_multistep_history_carries_no_gradient_into_the_previous_step():
    solver = MultistepSDE()
    v2, v3 = V.clone().requires_grad_(), (V * 0.5).requires_grad_()
    solver.transition(X, v2, SIGMA, SIGMA_NEXT, 0.9, step_index=2)
    mean, std = solver.transition(X, v3, SIGMA, SIGMA_NEXT, 0.9, step_index=3)
    mean.sum().backward()
    assert v2.grad is None and v3.grad is not None
    assert not solver.history[2].requires_grad
    assert _matches_oracle(X, 1.5 * v3.detach().double() - 0.5 * V.double(), mean.detach(), std, prev=X)


def test_sampling_without_a_generator_draws_from_the_default_stream():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = sde_step(FlowGRPOSDE(), X, V, SIGMA, SIGMA_NEXT, 0.9, trajectory_dtype=torch.float32)
        torch.manual_seed(0)
        noise = torch.randn(X.shape)
    mean, std = FlowGRPOSDE().transition(X, V, SIGMA, SIGMA_NEXT, 0.9)
    assert torch.equal(out.prev_sample, mean + std.reshape(-1, 1, 1) * noise)
    assert _matches_oracle(X, V, out.mean, out.std, prev=out.prev_sample)
