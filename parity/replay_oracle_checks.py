"""Oracle checks of the replay path: what stock and fast share, held to independent references.

Parity (batched == serial) cannot see a bug in code both paths call: the SDE step, its log-prob,
the rollout's draws, the CFG combine. These checks hold that code to fp64 formulas written from
docs/contracts.md (harness.replay.oracles), to torch.distributions.Normal and to the sampling distribution
itself. Two more close gaps parity leaves: pi_old replayed through the batched path against the
log-probs the rollout recorded (the real on-policy ratio), and the per-step error curve over all T
steps, whose growth is judged against the stock path's own per-step floor.

Tolerances come from a control measured beside the check (the same formula in fp32 against fp64, a
stock path at two batch shapes, the sample size of the draws) and are bounded on both sides.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fakes.replay_conditions import HI3_FIELDS, SD3_FIELDS, fused_conditions, uncond_first_conditions
from fakes.replay_kernel import FakeDenoiser
from fixtures.replay_cases import FAKE_LATENT, GUIDANCE, fake_problem, real_control, real_problem
from fixtures.replay_families import family_names
from fixtures.replay_models import tiny_model
from harness.judging import growth
from harness.judging.checks import register
from harness.judging.compare import Close, Verdict, close, exact, holds, max_abs_diff, noise_floor
from harness.judging.floors import StockFloor, reduction_ceiling_ulps
from harness.judging.floors import declare as declare_floor
from harness.judging.growth import growth_ratio
from harness.replay import denoiser, oracles
from harness.replay.conditions import Conditions, payload_rows, slice_rows
from harness.replay.controls import fast_shape_serial, measure_batch_shape_control, replay_terms
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST
from harness.replay.families import get_family
from harness.replay.judge import (
    ReplayRun,
    declared_output_dtype,
    judge_result,
    require_fast_path,
    run_batched,
    run_both,
)
from harness.replay.policies import ulp_of
from harness.replay.problem import ReplayProblem, make_problem
from harness.replay.replay import replay_serial
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import ConstantStdSDE, FlowGRPOSDE, SDEStrategy, sde_step

__all__ = ["FLAVOURS", "GROWTH_STEPS", "error_curves", "growth_problem", "growth_ratio", "single_step_policy"]

FP32_EPS = float(torch.finfo(torch.float32).eps)
ORACLE_ROWS = 16
ORACLE_STEPS = 8
# An implementation's fp32 error may be at most K x the error of the same formula evaluated in fp32
# (the control) against fp64; K lies in [K_MIN, K_MAX] or the check fails as too loose / too tight.
K_ORACLE, K_MIN, K_MAX = 8.0, 2.0, 32.0
DRAW_SIGMAS = 4.0  # draws: the sample mean / variance within 4 standard errors of n draws
DRAW_ROWS = 16
RATIO_FLOOR_MULTIPLE, RATIO_FLOOR_ULPS = 4.0, 4.0
ORACLE_FLOOR_ULPS = 1.0  # the fp32-vs-fp64 control's minimum: one fp32 ulp of the quantity's scale
FORMULA_STEPS = 16  # the SDE step's elementwise operations on one element (coefficients, mean, std, log-prob)
GROWTH_STEPS = 10  # all T steps replayed at once
GROWTH_BATCH = 2


@dataclass(frozen=True)
class Flavour:
    """One stateless SDE flavour and its oracle std_t."""

    strategy: SDEStrategy
    std_t: Callable[[torch.Tensor, float], torch.Tensor]


FLAVOURS = {
    "flowgrpo": Flavour(FlowGRPOSDE(eta=0.7), lambda sigma, s_max: oracles.flow_grpo_std_t64(sigma, s_max, 0.7)),
    "constant": Flavour(ConstantStdSDE(eta=0.5), lambda sigma, s_max: oracles.constant_std_t64(sigma, 0.5)),
}


ORACLE_POLICY = (f"noise_floor(error <= {K_ORACLE:g} x the formula's fp32-vs-fp64 error, at least "
                 f"{ORACLE_FLOOR_ULPS:g} fp32 ulp of the quantity's scale) against the fp64 oracle")
DRAWS_POLICY = f"close(atol=1): standardised draws' mean and variance within {DRAW_SIGMAS:g} standard errors"
RATIO_POLICY = f"close(atol={RATIO_FLOOR_MULTIPLE:g} x the pi_old ratio's stock floor) around exp(0) = 1"
GROWTH_POLICY = "per-step error growth <= the growth budget x the stock floor curve's growth (harness.judging.growth)"


def _register(check_id: str, fn, *args, doc: str, policy: str = ORACLE_POLICY) -> None:
    register(check_id, doc=doc, policy=policy)(functools.partial(fn, *args))


# ------------------------------------------------------------------------------------- SDE oracles


@dataclass(frozen=True)
class SDEInputs:
    """Seeded rows spread over every step of a schedule, step 0 (sigma == 1) included."""

    x: torch.Tensor
    v: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    sigma_max: torch.Tensor
    noise: torch.Tensor


@functools.cache
def sde_inputs() -> SDEInputs:
    gen = torch.Generator().manual_seed(123)
    schedule = flow_sigmas(ORACLE_STEPS)
    steps = torch.arange(ORACLE_ROWS) % ORACLE_STEPS
    shape = (ORACLE_ROWS, *FAKE_LATENT)
    return SDEInputs(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), schedule[steps],
                     schedule[steps + 1], schedule[1], torch.randn(shape, generator=gen))


def _oracle_transition(flavour: Flavour, inputs: SDEInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) from the formulas of docs/contracts.md in fp64: the oracle."""
    std_t = flavour.std_t(inputs.sigma, float(inputs.sigma_max))
    mean = oracles.flow_mean64(inputs.x, inputs.v, inputs.sigma, inputs.sigma_next, std_t)
    return mean, oracles.std64(std_t, inputs.sigma, inputs.sigma_next)


def _control_transition(flavour: Flavour, inputs: SDEInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) from the same formulas with every operation rounded to fp32: the control."""
    std_t = flavour.std_t(inputs.sigma, float(inputs.sigma_max)).float()
    sigma, sigma_next = inputs.sigma.float(), inputs.sigma_next.float()
    dt = sigma_next - sigma
    var = std_t * std_t
    x_coef = (1.0 + var / (2.0 * sigma) * dt).reshape(-1, 1, 1, 1)
    v_coef = ((1.0 + var * (1.0 - sigma) / (2.0 * sigma)) * dt).reshape(-1, 1, 1, 1)
    return inputs.x * x_coef + inputs.v * v_coef, std_t * torch.sqrt(sigma - sigma_next)


def _prev(inputs: SDEInputs, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """A draw from the oracle's distribution, round-tripped through the trajectory dtype (bf16)."""
    fp32 = (mean + std.reshape(-1, 1, 1, 1) * inputs.noise.double()).float()
    return fp32.to(torch.bfloat16)


def _bounded(what: str, actual: torch.Tensor, oracle: torch.Tensor, control: float,
             scale: float) -> Verdict:
    """error <= K x control; the control (the formula in fp32 vs fp64) has a minimum of one fp32 ulp of the
    quantity's scale (a formula evaluated exactly in fp32 has error 0), and K must lie in [K_MIN, K_MAX]."""
    terms = max(FORMULA_STEPS, actual[0].numel())  # a row's log-prob is a mean over its latent elements
    floor = StockFloor(control, scale, ORACLE_FLOOR_ULPS, source="the formula in fp32 vs fp64",
                       ceiling_ulps=reduction_ceiling_ulps(terms),
                       ceiling_reason=f"K = {terms}: the formula's elementwise steps and a row's mean over its "
                                      "latent elements", control="dtype")
    policy = noise_floor(floor.value, k=K_ORACLE, reason=f"{what}: fp32 rounding; {floor.describe()}")
    verdict = policy.judge(actual.double(), oracle.double(), dims=("row",), what=what)
    verdict = verdict.require(floor.value > 0 and math.isfinite(floor.value),
                              f"{what}: control floor measured (finite, > 0)", control=control)
    return verdict.require_bounded(policy.bound, floor, k_min=K_MIN, k_max=K_MAX, what=f"{what} tolerance")


def oracle_mean(name: str) -> Verdict:
    flavour, inputs = FLAVOURS[name], sde_inputs()
    mean, _ = flavour.strategy.transition(inputs.x, inputs.v, inputs.sigma, inputs.sigma_next, inputs.sigma_max)
    oracle, _ = _oracle_transition(flavour, inputs)
    control, _ = _control_transition(flavour, inputs)
    return _bounded("transition mean", mean, oracle, max_abs_diff(control.double(), oracle),
                    float(oracle.abs().max()))


def oracle_std(name: str) -> Verdict:
    flavour, inputs = FLAVOURS[name], sde_inputs()
    _, std = flavour.strategy.transition(inputs.x, inputs.v, inputs.sigma, inputs.sigma_next, inputs.sigma_max)
    _, oracle = _oracle_transition(flavour, inputs)
    _, control = _control_transition(flavour, inputs)
    return _bounded("transition std", std, oracle, max_abs_diff(control.double(), oracle),
                    float(oracle.abs().max()))


def _scored(flavour: Flavour, inputs: SDEInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(implementation log-prob, prev in bf16, oracle mean, oracle std) for one seeded draw per row."""
    mean64, std64 = _oracle_transition(flavour, inputs)
    prev = _prev(inputs, mean64, std64)
    step = sde_step(flavour.strategy, inputs.x, inputs.v, inputs.sigma, inputs.sigma_next, inputs.sigma_max,
                    trajectory_dtype=torch.bfloat16, prev=prev.float())
    return step.log_prob, prev, mean64, std64


def oracle_log_prob_fp64(name: str) -> Verdict:
    """sde_step's log-prob of a bf16-stored draw against the formula in fp64."""
    flavour, inputs = FLAVOURS[name], sde_inputs()
    log_prob, prev, mean64, std64 = _scored(flavour, inputs)
    oracle = oracles.gaussian_log_prob64(prev, mean64, std64)
    control = _control_log_prob(prev, mean64, std64)
    return _bounded("log_prob", log_prob, oracle, max_abs_diff(control.double(), oracle),
                    float(oracle.abs().max()))


def _control_log_prob(prev: torch.Tensor, mean64: torch.Tensor, std64: torch.Tensor) -> torch.Tensor:
    """The log-prob formula with every operation in fp32 (the control of the fp64 oracle)."""
    mean, std = mean64.float(), std64.float().reshape(-1, 1, 1, 1).expand_as(mean64).contiguous()
    diff = prev.float() - mean
    element = -(diff * diff) / (2.0 * std * std) - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    return element.reshape(element.shape[0], -1).mean(dim=1)


def oracle_log_prob_normal(name: str) -> Verdict:
    """sde_step's log-prob against torch.distributions.Normal, averaged over non-batch dims."""
    flavour, inputs = FLAVOURS[name], sde_inputs()
    log_prob, prev, mean64, std64 = _scored(flavour, inputs)
    scale64 = std64.reshape(-1, 1, 1, 1).expand_as(mean64)
    reference = torch.distributions.Normal(mean64, scale64).log_prob(prev.double()).flatten(1).mean(dim=1)
    control = torch.distributions.Normal(mean64.float(), scale64.float()).log_prob(prev.float()).flatten(1).mean(dim=1)
    verdict = _bounded("log_prob vs Normal", log_prob, reference,
                       max_abs_diff(control.double(), reference), float(reference.abs().max()))
    return verdict.require(prev.dtype == torch.bfloat16, "prev scored as stored, round-tripped through bf16")


for _name in FLAVOURS:
    _register(f"replay.oracle.{_name}.mean", oracle_mean, _name,
              doc=f"{_name} SDE: transition mean against the fp64 formula (docs/contracts.md)")
    _register(f"replay.oracle.{_name}.std", oracle_std, _name,
              doc=f"{_name} SDE: transition std against the fp64 formula (docs/contracts.md)")
    _register(f"replay.oracle.{_name}.log_prob_fp64", oracle_log_prob_fp64, _name,
              doc=f"{_name} SDE: log-prob of a bf16-stored draw against the fp64 formula")
    _register(f"replay.oracle.{_name}.log_prob_normal", oracle_log_prob_normal, _name,
              doc=f"{_name} SDE: log-prob of a bf16-stored draw against torch.distributions.Normal")


# ------------------------------------------------------------------------------- the rollout's draws


@register("replay.oracle.rollout.draws", policy=DRAWS_POLICY)
def rollout_draws() -> Verdict:
    """A seeded rollout's SDE draws, standardised by the fp64 oracle's mean and std, have mean 0 and
    variance 1 within DRAW_SIGMAS standard errors of the number of draws."""
    gen = torch.Generator().manual_seed(31)
    adapter = FakeDenoiser(FUSED_COND_FIRST, FAKE_LATENT, 31)
    conditions = fused_conditions(DRAW_ROWS, HI3_FIELDS, 1, gen)
    flavour = FLAVOURS["flowgrpo"]
    sigmas = flow_sigmas(ORACLE_STEPS)
    sde = tuple(range(ORACLE_STEPS))
    segment = rollout(adapter, conditions, flavour.strategy, sigmas, sde, FAKE_LATENT,
                      generator=torch.Generator().manual_seed(32))
    z = []
    for step in sde:
        x = segment.latent_at(step).float()
        sigma, sigma_next = sigmas[step].expand(DRAW_ROWS), sigmas[step + 1].expand(DRAW_ROWS)
        v = denoiser.predict_velocity(adapter, x, sigma, conditions, 1.0)
        std_t = flavour.std_t(sigma, float(sigmas[1]))
        mean = oracles.flow_mean64(x, v, sigma, sigma_next, std_t)
        std = oracles.std64(std_t, sigma, sigma_next).reshape(-1, 1, 1, 1)
        z.append(((segment.latent_at(step + 1).double() - mean) / std).flatten())
    draws = torch.cat(z)
    n = draws.numel()
    moments = torch.stack([draws.mean(), draws.var()])
    bounds = torch.tensor([DRAW_SIGMAS / math.sqrt(n), DRAW_SIGMAS * math.sqrt(2.0 / (n - 1))], dtype=torch.float64)
    error = (moments - torch.tensor([0.0, 1.0], dtype=torch.float64)).abs() / bounds
    policy = close(atol=1.0, rtol=0.0, reason=f"standardised draws: |mean| <= {DRAW_SIGMAS:g}/sqrt(n), "
                                              f"|var - 1| <= {DRAW_SIGMAS:g} sqrt(2/(n-1)), n = {n}")
    verdict = policy.judge(error, torch.zeros_like(error), dims=("moment",),
                           labels={"moment": ["mean", "variance"]}, what="moment error in standard errors")
    return verdict.with_metrics(draws=n, sample_mean=float(moments[0]), sample_var=float(moments[1]),
                                mean_bound=float(bounds[0]), var_bound=float(bounds[1]))


# -------------------------------------------------------------------------------------- CFG combine


def _branch(conditions: Conditions, branch: int) -> Conditions:
    """One branch of fused cond-first conditions: a 2B field's half, a B field as is."""
    batch = conditions.batch
    rows = {}
    for name, value in conditions.rows.items():
        per_branch = payload_rows(value) == 2 * batch
        rows[name] = slice_rows(value, branch * batch, (branch + 1) * batch) if per_branch else value
    return Conditions(batch=batch, rows=rows, shared=conditions.shared)


@functools.cache
def _cfg_case(layout: str) -> tuple[FakeDenoiser, Conditions, Conditions, Conditions]:
    """(adapter, guided conditions, cond-only, uncond-only) for one CFG layout."""
    gen = torch.Generator().manual_seed(41)
    adapter = FakeDenoiser(layout, FAKE_LATENT, 41)
    if layout == FUSED_COND_FIRST:
        guided = fused_conditions(3, HI3_FIELDS, 2, gen)
        return adapter, guided, _branch(guided, 0), _branch(guided, 1)
    guided = uncond_first_conditions(3, SD3_FIELDS, 2, gen)
    cond = Conditions(batch=guided.batch, rows=guided.rows, shared=guided.shared)
    uncond = Conditions(batch=guided.batch, rows=guided.negative.rows, shared=guided.shared)
    return adapter, guided, cond, uncond


def cfg_standard(case: str, layout: str) -> Verdict:
    """predict_velocity's guided velocity against uncond + g (cond - uncond) in fp64 of the two
    branches run alone."""
    adapter, guided, cond, uncond = _cfg_case(layout)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn((guided.batch, *FAKE_LATENT), generator=gen)
    sigma = torch.full((guided.batch,), 0.6)
    velocity = denoiser.predict_velocity(adapter, x, sigma, guided, GUIDANCE)
    timestep = adapter.timestep(sigma)
    v_cond = adapter.forward(x, timestep, cond)
    v_uncond = adapter.forward(x, timestep, uncond)
    oracle = oracles.cfg_standard64(v_cond, v_uncond, GUIDANCE)
    control = v_uncond + GUIDANCE * (v_cond - v_uncond)
    return _bounded(f"CFG velocity (g={GUIDANCE:g})", velocity, oracle,
                    max_abs_diff(control.double(), oracle), float(oracle.abs().max()))


_register("replay.oracle.cfg.fused", cfg_standard, "fused", FUSED_COND_FIRST,
          doc="fused cond-first CFG combine against uncond + g (cond - uncond) in fp64")
_register("replay.oracle.cfg.uncond_first", cfg_standard, "uncond_first", UNCOND_FIRST,
          doc="uncond-first CFG combine against uncond + g (cond - uncond) in fp64")


# ------------------------------------------------------------------ pi_old against the rollout's record


def fresh_problem(case: str) -> ReplayProblem:
    """The fake problem rolled out again now (not cached), so the rollout's recording is under test."""
    base = fake_problem(case)
    return make_problem(f"{case}.fresh", base.adapter, base.conditions, seed=len(case), latent_shape=FAKE_LATENT,
                        guidance=base.guidance)


def fresh_real_problem(family: str, cfg: int) -> ReplayProblem:
    """The tiny diffusers problem rolled out again now, with fixtures.replay_cases.real_problem's seed."""
    base = real_problem(family, cfg)
    return make_problem(f"{family}.cfg{cfg}.fresh", base.adapter, base.conditions, seed=cfg,
                        latent_shape=base.adapter.latent_shape, guidance=base.guidance)


def ratio_floor(problem: ReplayProblem, batch_shape_floor: float) -> tuple[float, float]:
    """(stock floor, its serial-vs-rollout part): max |exp(serial - recorded) - 1| over every row and
    step, or the model's batch-shape floor of the log-probs if larger (both measured on stock code).

    Measure it on the cached reference rollout, never on the rollout under test: a rollout bug would
    otherwise widen its own tolerance."""
    serial = replay_serial(problem.adapter, problem.conditions, problem.segment, problem.strategy, problem.target,
                           problem.guidance, problem.config)
    recorded = problem.segment.recorded_log_probs(problem.target)
    rollout_floor = max_abs_diff(torch.exp(serial.log_probs.double() - recorded.double()),
                                 torch.ones_like(recorded, dtype=torch.float64))
    return max(rollout_floor, batch_shape_floor), rollout_floor


@functools.cache
def fake_ratio_floor(case: str) -> tuple[float, float, float]:
    """(stock floor, serial vs rollout, batch shape) of a cached fake problem, measured once."""
    reference = fake_problem(case)
    shape = measure_batch_shape_control(reference).max_deviation("log_probs")
    return (*ratio_floor(reference, shape), shape)


@functools.cache
def real_ratio_floor(family: str, cfg: int) -> tuple[float, float, float]:
    shape = real_control(family, cfg).max_deviation("log_probs")
    return (*ratio_floor(real_problem(family, cfg), shape), shape)


def ratio_stock_floor(problem: ReplayProblem, floors: tuple[float, float, float]) -> StockFloor:
    """The pi_old ratio's floor with its minimum: RATIO_FLOOR_ULPS ulps of the ratio's own magnitude (1), or of
    the log-probs whose difference it exponentiates where those are larger (their spacing is the difference's
    resolution). The measured floor may be exactly zero: replaying on a batch-invariant host is bitwise."""
    floor, rollout_floor, batch_shape_floor = floors
    recorded = problem.segment.recorded_log_probs(problem.target)
    terms = replay_terms(problem)
    ceiling = {"ceiling_ulps": max(reduction_ceiling_ulps(terms), RATIO_FLOOR_ULPS),
               "ceiling_reason": f"K = {terms}: the denoiser's Linear/Conv fan-ins and the latent's elements"} \
        if terms else {}
    return StockFloor(floor, max(1.0, float(recorded.abs().max())), RATIO_FLOOR_ULPS,
                      source=f"serial replay vs rollout {rollout_floor:.2e}, batch shape {batch_shape_floor:.2e}",
                      **ceiling)


def pi_old_vs_rollout(problem: ReplayProblem, floors: tuple[float, float, float]) -> Verdict:
    """exp(logp replayed through the batched path - logp recorded at rollout) == 1 per row and step,
    within a multiple of the stock floor measured on the reference rollout."""
    recorded = problem.segment.recorded_log_probs(problem.target)
    stock = ratio_stock_floor(problem, floors)
    atol = RATIO_FLOOR_MULTIPLE * stock.value
    policy = close(atol=atol, rtol=0.0, reason=f"{RATIO_FLOOR_MULTIPLE:g} x the ratio's stock {stock.describe()}")
    result, forwards = run_batched(problem)
    if result is None:
        return holds(False, "batched replay returned a result for pi_old")
    rounded = declared_output_dtype("log_probs", result.log_probs.dtype, problem.segment.dtype)
    if rounded is not None:  # log-probs in the trajectory dtype by the declared convention: the record rounded alike
        recorded = recorded.to(rounded)
        rounding = float(ulp_of(recorded.abs().max(), rounded))
        policy = close(atol=atol + rounding, rtol=0.0, reason=f"{policy.reason}, + 1 {rounded} ulp of max |log-prob| "
                                                              f"{rounding:.2e} (log-probs returned in {rounded}, the "
                                                              "declared trajectory dtype)")
    elif result.log_probs.dtype != recorded.dtype:
        return judge_result(policy, result.log_probs, recorded, problem.target, "log_probs", problem.segment.dtype)
    ratio = torch.exp(result.log_probs.double() - recorded.double())
    verdict = judge_result(policy, ratio, torch.ones_like(ratio), problem.target, "pi_old ratio")
    verdict = verdict.require(math.isfinite(stock.value), "stock floor of the pi_old ratio measured (finite)",
                              rollout_floor=floors[1], batch_shape_floor=floors[2])
    verdict = verdict.require_bounded(atol, stock, k_min=1.0, k_max=RATIO_FLOOR_MULTIPLE, what="pi_old ratio atol")
    return require_fast_path(verdict, problem, forwards)


def fake_pi_old_vs_rollout(case: str) -> Verdict:
    return pi_old_vs_rollout(fresh_problem(case), fake_ratio_floor(case))


for _case in ("cfg2", "uncond_first"):
    _register(f"replay.{_case}.pi_old_vs_rollout", fake_pi_old_vs_rollout, _case, policy=RATIO_POLICY,
              doc="pi_old replayed through the batched path against the log-probs a fresh rollout recorded")


@register("replay.flux.cfg2.pi_old_vs_rollout", policy=RATIO_POLICY)
def flux_pi_old_vs_rollout() -> Verdict:
    """Tiny Flux (fused cond-first): the batched pi_old ratio against the rollout's record, within the
    measured fp32 floor."""
    return pi_old_vs_rollout(fresh_real_problem("flux", 2),
                             real_ratio_floor("flux", 2))


# ------------------------------------------------------------------------------------- error growth


@functools.cache
def growth_problem(family: str = "sd3", cfg: int = 1) -> ReplayProblem:
    """A tiny model of a registered family (cfg 1: no CFG; cfg 2: both branches at the default scale), SDE on all
    T steps, every step replayed at once."""
    registered = get_family(family)
    adapter = registered.adapter(tiny_model(family))
    conditions = registered.example_conditions(adapter, GROWTH_BATCH, cfg, torch.Generator().manual_seed(5))
    steps = tuple(range(GROWTH_STEPS))
    return make_problem(f"{family}.cfg{cfg}.growth", adapter, conditions, seed=21, latent_shape=adapter.latent_shape,
                        target=steps, sde_indices=steps, steps=GROWTH_STEPS, guidance=1.0 if cfg == 1 else GUIDANCE)


def _per_step(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Mean |actual - expected| per step of ``[B, S, ...]`` tensors (fp64, NaN stays NaN)."""
    diff = (actual.double() - expected.double()).abs()
    return diff.transpose(0, 1).reshape(diff.shape[1], -1).mean(dim=1)


@functools.cache
def _stock_runs(family: str, cfg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(serial replay's means at B rows, the same with every forward at the fast path's shape) of the family's
    growth problem: the stock side of its growth check, run once."""
    problem = growth_problem(family, cfg)
    base = replay_serial(*problem.args())
    grown = fast_shape_serial(problem)
    return base.prev_sample_means, grown.prev_sample_means


def stock_floor_curve(family: str = "sd3", cfg: int = 1) -> tuple[float, ...]:
    """The stock per-step floor: serial replay at B rows vs serial replay with every forward at the fast path's
    shape (all S x cfg x B rows, each step's rows at their block)."""
    base, grown = _stock_runs(family, cfg)
    return tuple(_per_step(grown, base).tolist())


def resolution_curve(family: str = "sd3", cfg: int = 1) -> tuple[float, ...]:
    """One fp32 ulp at each step's mean |transition mean| (the stock values'): below it, a per-step difference
    is the values' own spacing."""
    means = _stock_runs(family, cfg)[0].double().abs()
    return tuple((FP32_EPS * means.transpose(0, 1).reshape(means.shape[1], -1).mean(dim=1)).tolist())


def error_curves(problem: ReplayProblem, family: str = "sd3",
                 cfg: int = 1) -> tuple[ReplayRun, torch.Tensor | None, torch.Tensor]:
    """(run, batched-vs-serial per-step error of the means or None on a fallback, stock per-step floor). Means an
    implementation returns in the trajectory dtype by its declared convention are compared with serial's rounded
    the same way."""
    run = run_both(problem)
    curve = None
    if run.batched is not None:
        serial = run.serial.prev_sample_means
        if declared_output_dtype("prev_sample_means", run.batched.prev_sample_means.dtype, problem.segment.dtype):
            serial = serial.to(run.batched.prev_sample_means.dtype)
        curve = _per_step(run.batched.prev_sample_means, serial)
    return run, curve, torch.tensor(stock_floor_curve(family, cfg), dtype=torch.float64)


def single_step_policy(problem: ReplayProblem) -> Close:
    """The policy a worst-element check would use on this problem: max(4 x the stock max-abs floor at the fast
    path's shape, 4 fp32 ulps x the latents' scale) -- the bound the drift ablation stays under."""
    base = replay_serial(*problem.args())
    grown = fast_shape_serial(problem)
    floor = max_abs_diff(grown.prev_sample_means, base.prev_sample_means)
    scale = float(problem.segment.latents.float().abs().max())
    return close(atol=max(4.0 * floor, 4.0 * FP32_EPS * scale), rtol=0.0,
                 reason=f"single-step: max(4 x floor {floor:.2e}, 4 fp32 ulps x {scale:.2e})")


def error_growth(family: str, cfg: int) -> Verdict:
    """A family's tiny model over all T steps at ``cfg``: the per-step error of the batched means (mean |batched -
    serial|) may grow at most GROWTH_BUDGET x as fast as the stock floor (serial at B rows vs at the fast path's
    shape). At cfg 2 both branches and the combine run at every step, so a drift in the uncond half (or anything
    only a two-branch forward does) compounds here, where cfg 1 never looks."""
    problem = growth_problem(family, cfg)
    run, curve, floor = error_curves(problem, family, cfg)
    if curve is None:
        return holds(False, "batched replay returned a result (no silent fallback)")
    resolution = torch.tensor(resolution_curve(family, cfg), dtype=torch.float64)
    means = run.batched.prev_sample_means
    if declared_output_dtype("prev_sample_means", means.dtype, problem.segment.dtype):
        # judged in the declared output dtype: below one of its ulps at a step's magnitude, a difference is rounding
        magnitude = means.double().abs().transpose(0, 1).reshape(means.shape[1], -1).mean(dim=1)
        resolution = torch.maximum(resolution, ulp_of(magnitude, means.dtype))
    elif means.dtype != torch.float32:
        return judge_result(exact(), means, run.serial.prev_sample_means, problem.target, "prev_sample_means",
                            problem.segment.dtype)
    verdict = growth.judge_growth(curve, floor, resolution,
                                  control=f"stock serial at B rows vs serial with every forward at the fast path's "
                                          f"{problem.batched_rows}-row shape (cfg {cfg}), mean |d| of the means per "
                                          "step")
    stock = growth_stock_floor(family, cfg)
    verdict = verdict.with_metrics(**stock.metrics()).require(not stock.above_ceiling, stock.ceiling_fact())
    return require_fast_path(verdict, problem, run.batched_forwards, run.serial_forwards)


@functools.cache
def growth_stock_floor(family: str = "sd3", cfg: int = 1) -> StockFloor:
    """The growth control's worst element (stock serial at B rows vs at the fast path's shape) under its ceiling:
    the control runs the family's adapter at the fast path's shape, so a stock path that depends on what shares
    its forward would otherwise widen the very curve the batched error is judged against."""
    problem = growth_problem(family, cfg)
    base, grown = _stock_runs(family, cfg)
    terms = max(1, replay_terms(problem))
    return StockFloor(max_abs_diff(grown, base), float(base.abs().max()), 1.0,
                      source="stock serial at B rows vs at the fast path's shape, every step",
                      ceiling_ulps=reduction_ceiling_ulps(terms),
                      ceiling_reason=f"K = {terms}: the denoiser's Linear/Conv fan-ins and the latent's elements")


for _family in family_names():
    _register(f"replay.{_family}.growth.prev_sample_means", error_growth, _family, 1, policy=GROWTH_POLICY,
              doc=f"tiny {_family} at cfg 1 over all T steps: batched-mean error grows no faster than the stock floor")
    _register(f"replay.{_family}.cfg2.growth.prev_sample_means", error_growth, _family, 2, policy=GROWTH_POLICY,
              doc=f"tiny {_family} at cfg 2 over all T steps: batched-mean error grows no faster than the stock floor")

declare_floor("replay.oracle.*", f"{ORACLE_FLOOR_ULPS:g} fp32 ulp of the quantity's scale (fp32 vs fp64)",
              "8 sqrt(K) fp32 ulps, K = the formula's elementwise steps or a row's mean over its latent elements")
declare_floor("replay.*pi_old_vs_rollout", f"{RATIO_FLOOR_ULPS:g} fp32 ulps of the ratio's or log-probs' magnitude",
              "8 sqrt(K) fp32 ulps, K = the denoiser's Linear/Conv fan-ins plus the latent's elements")
