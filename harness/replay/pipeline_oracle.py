"""The pipeline oracle: a family's adapter held to what its real diffusers pipeline hands the transformer.

Parity (batched vs serial) cannot see a bug that hits stock and fast alike: a timestep in the wrong
units, a CFG branch order declared backwards. Both are properties of how the adapter translates a
pipeline's step into a model call, so the oracle runs the family's registered pipeline
(``ReplayFamily.pipeline``) for ORACLE_STEPS steps from encoded prompts (no text encoder) with
``output_type="latent"``, records every transformer forward (its arguments, bound to the forward's
signature, and its output) and the combined prediction the pipeline hands its scheduler, then runs the
adapter's denoiser (``predict_velocity``) at the same latents and sigma and holds it to the pipeline. A row
argument or output is a tensor whose dim 0 is the row or a list with one item per row (a transformer that takes
one latent per sample, captions of different lengths with no mask): either is recorded, lined up and compared row
by row, in the kind the transformer took it.

- inputs, row by row, the pipeline's branches told apart by their prompt rows: the rows the adapter
  declares cond carry the pipeline's cond inputs (CFG order: a row that carries the other branch's prompt), and
  every row argument (the prompt, masks, pooled embeddings, guidance, latents) equals the pipeline's bitwise, each
  row that differs named with its field; the timestep within TIMESTEP_ULPS fp32 ulps of the pipeline's (the
  pipeline derives t and sigma from each other through a few fp32 roundings; a wrong unit is off by orders of
  magnitude);
  shared arguments (ids, image shapes) equal;
- outputs: each branch's transformer output, and the velocity (the family's combine and ``velocity``
  transform), within K_OUTPUT x a floor plus the effect of the timestep's allowed difference. The floor is
  the transformer on the pipeline's own inputs and timestep in one forward of the adapter's rows and
  positions: it differs from the pipeline's calls only in how the rows are grouped, so it is rounding, held
  under its ceiling (harness.judging.floors: K = the transformer's Linear/Conv fan-ins and the tokens attended
  over); at least RESOLUTION (4 fp32 ulps) of the local magnitude (per row). The velocity's floor is the family's
  own combine of those outputs against its combine of the pipeline's, so a combine that is not the pipeline's
  fails the combine part below, never this floor's ceiling. The timestep allowance is the same forward at the
  adapter's own timestep against it: exactly what the allowed timestep difference does, zero when the two
  timesteps agree bitwise;
- the family's declared combine and velocity transform applied to the pipeline's own branch outputs equal the
  pipeline's combined prediction (only the arithmetic's rounding, RESOLUTION, may differ); a failure names the
  declared combine and the samples where it differs. A velocity that is the exact negation of the pipeline's
  (relative error 2) is named a sign flip: the pipeline post-processes the model output and the family's
  ``velocity`` does not say so.

A family whose pipeline is not a diffusers class (HunyuanImage-3's loop ships in its remote code) registers its own
oracle on its ``PipelineSpec`` (``oracle``); ``run_pipeline``, ``align_family`` and ``judge_family`` hand such a
family to it, and it judges with the pieces below.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.judging.compare import Verdict, close, holds, noise_floor
from harness.judging.floors import StockFloor, module_reduction_terms, reduction_ceiling_ulps
from harness.replay import denoiser
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, ReplayFamily

__all__ = [
    "COMBINE_POLICY",
    "K_OUTPUT",
    "ORACLE_STEPS",
    "RESOLUTION",
    "TIMESTEP_ULPS",
    "Forward",
    "OracleError",
    "PipelineRecord",
    "PipelineStep",
    "align_family",
    "judge_combine",
    "judge_family",
    "record_forwards",
    "run_pipeline",
    "sign_flipped",
]

ORACLE_STEPS = 2
FP32_EPS = float(torch.finfo(torch.float32).eps)
TIMESTEP_ULPS = 16.0  # the pipeline's t and sigma meet through its scheduler's fp32 shift and a division by 1000
RESOLUTION = 4 * FP32_EPS  # the least relative bound of an output: 4 fp32 ulps of its local magnitude
K_OUTPUT, K_MIN, K_MAX = 4.0, 2.0, 8.0
PROMPT_KEY, NEGATIVE_KEY = "prompt_embeds", "negative_prompt_embeds"


class OracleError(ValueError):
    """The oracle cannot line the pipeline's forwards up with the adapter's (a family registration problem)."""


@dataclass(frozen=True, eq=False)
class Forward:
    """One transformer call: its arguments bound to ``forward``'s signature (defaults applied) and output (a
    tensor, or a list of per-row tensors when the transformer returns lists)."""

    arguments: dict[str, Any]
    output: Any


@dataclass(frozen=True, eq=False)
class PipelineStep:
    """What one denoising step of the pipeline did: its sigma, the latents it stepped, the transformer
    calls it made and the combined prediction it handed the scheduler."""

    sigma: torch.Tensor
    latents: torch.Tensor
    model_output: torch.Tensor
    forwards: tuple[Forward, ...]


@dataclass(frozen=True, eq=False)
class PipelineRecord:
    """One pipeline run: its prompts and guidance, the replay-layout latents it was started from, its steps."""

    prompts: Prompts
    guidance: float
    start: torch.Tensor
    steps: tuple[PipelineStep, ...]


def _bind(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _copied(value: Any) -> Any:
    """A copy of a forward's output as it was when the forward returned: tensors cloned, lists item by item (a
    module may reuse its output buffers on its next call)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value


def model_output(output: Any) -> Any:
    """The prediction in what a diffusers transformer returns: the first item of its ``return_dict=False`` tuple,
    the ``sample`` of its output object, or the value itself (a tensor, or a list of per-row tensors)."""
    if isinstance(output, tuple):
        return output[0]
    if not isinstance(output, (torch.Tensor, list)) and hasattr(output, "sample"):
        return output.sample
    return output


@contextlib.contextmanager
def record_forwards(module: torch.nn.Module) -> Iterator[list[Forward]]:
    """Every forward of ``module`` while the block runs: bound arguments and a copy of its prediction
    (``model_output``)."""
    calls: list[Forward] = []

    def hook(mod, args, kwargs, output) -> None:
        calls.append(Forward(_bind(mod, args, kwargs), _copied(model_output(output))))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def build_pipeline(family: ReplayFamily, adapter: ModelAdapter) -> Any:
    """The family's registered pipeline around the adapter's transformer, every other component None."""
    if family.pipeline is None:
        raise OracleError(f"replay family {family.name!r} registers no pipeline (ReplayFamily.pipeline): the pipeline "
                          "oracle has nothing to hold its adapter to")
    cls = family.pipeline.pipeline_class()
    names = [name for name, p in inspect.signature(cls.__init__).parameters.items()
             if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    components = dict.fromkeys(names)
    components.update(transformer=adapter.module, scheduler=family.pipeline.scheduler())
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(family: ReplayFamily, adapter: ModelAdapter, prompts: Prompts, latents: torch.Tensor,
                 guidance: float, steps: int = ORACLE_STEPS) -> PipelineRecord:
    """Run the family's pipeline for ``steps`` steps from ``prompts`` and replay-layout ``latents``."""
    if family.pipeline is not None and family.pipeline.oracle is not None:
        return family.pipeline.own_oracle().run_pipeline(family, adapter, prompts, latents, guidance, steps)
    dtypes = sorted({str(p.dtype) for p in adapter.module.parameters()} | {str(latents.dtype)})
    if dtypes != [str(torch.float32)]:
        raise OracleError(f"the pipeline oracle judges fp32 pipelines (its timestep room is {TIMESTEP_ULPS:g} fp32 "
                          f"ulps and its floors are fp32 floors); the transformer and latents hold {dtypes}")
    pipe = build_pipeline(family, adapter)
    scheduler_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    step = pipe.scheduler.step

    def recording_step(model_output, timestep, sample, *args, **kwargs):
        scheduler_calls.append((model_output.clone(), sample.clone()))  # under no_grad: no graph
        return step(model_output, timestep, sample, *args, **kwargs)

    pipe.scheduler.step = recording_step
    h, w = adapter.latent_size
    kwargs = {**prompts, **family.pipeline.call_kwargs, family.pipeline.guidance_kwarg: guidance,
              "latents": adapter.to_pipeline_latents(latents), "height": h * pipe.vae_scale_factor,
              "width": w * pipe.vae_scale_factor, "num_inference_steps": steps, "output_type": "latent"}
    with torch.no_grad(), record_forwards(adapter.module) as calls:
        pipe(**kwargs)  # what it returns is not read: the record is the transformer's calls and the scheduler's
    if len(scheduler_calls) != steps:
        raise OracleError(f"{family.pipeline.class_name} stepped its scheduler {len(scheduler_calls)} times for "
                          f"num_inference_steps={steps}")
    grouped = _group_by_step(calls, len(calls) // steps, steps)
    sigmas = pipe.scheduler.sigmas
    return PipelineRecord(prompts, guidance, latents.clone(), tuple(
        PipelineStep(sigmas[i].to(torch.float32), sample, output, grouped[i])
        for i, (output, sample) in enumerate(scheduler_calls)))


def _group_by_step(calls: Sequence[Forward], per_step: int, steps: int) -> list[tuple[Forward, ...]]:
    if per_step < 1 or per_step * steps != len(calls):
        raise OracleError(f"the pipeline made {len(calls)} transformer calls over {steps} steps; expected the same "
                          "number at every step")
    return [tuple(calls[i * per_step:(i + 1) * per_step]) for i in range(steps)]


# ------------------------------------------------------------------------------------------- comparing


def _normal(value: Any) -> Any:
    """A comparable form: an empty mapping is None (``joint_attention_kwargs={}`` vs left out)."""
    if isinstance(value, Mapping):
        return {k: _normal(v) for k, v in sorted(value.items())} or None
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors by shape and value (dtype aside: an int64 mask equals a long one), containers
    item by item."""
    a, b = _normal(a), _normal(b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.equal(a.double(), b.double()))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _count(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    return len(value) if isinstance(value, (list, tuple)) else None


def _gathered(like: Any, rows: Sequence[Any]) -> Any:
    """``rows`` in the kind of the value they came from: a tensor's rows stacked into a tensor, the items of a
    list (or tuple) kept as a list, so rows of different shapes (ragged captions) never meet in a stack."""
    return torch.stack(list(rows)) if isinstance(like, torch.Tensor) else list(rows)


def row_list(value: Any) -> list[torch.Tensor]:
    """The per-row tensors of a row value: a tensor's rows, or a list's (tuple's) items."""
    if isinstance(value, torch.Tensor) and value.dim():
        return list(value.unbind(0))
    if isinstance(value, (list, tuple)) and all(isinstance(item, torch.Tensor) for item in value):
        return list(value)
    raise OracleError(f"expected a tensor of rows or a list of per-row tensors, got {type(value).__name__}")


def _negated(value: Any) -> Any:
    return -value if isinstance(value, torch.Tensor) else [-row for row in row_list(value)]


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def adapter_order(layout: str, batch: int) -> list[tuple[str, int]]:
    """(branch, sample) of each row of the adapter's two-branch forward, as its layout declares them."""
    first, second = ("uncond", "cond") if layout == UNCOND_FIRST else ("cond", "uncond")
    return [(first, b) for b in range(batch)] + [(second, b) for b in range(batch)]


@dataclass(frozen=True, eq=False)
class AlignedStep:
    """The pipeline's forwards of one step rearranged into the adapter's rows: every row argument (and the
    output) in ``order``, each in the kind the transformer took it (a tensor's rows stacked, a list's items
    listed), the shared arguments as the pipeline passed them."""

    order: list[tuple[str, int]]
    rows: dict[str, Any]
    shared: dict[str, Any]
    output: Any


def align(step: PipelineStep, prompts: Prompts, prompt_arg: str, order: list[tuple[str, int]]) -> AlignedStep:
    """Tell the pipeline's branches apart by their prompt rows and lay its rows out in ``order``."""
    references = {"cond": prompts[PROMPT_KEY], "uncond": prompts[NEGATIVE_KEY]}
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for index, forward in enumerate(step.forwards):
        if prompt_arg not in forward.arguments or _count(forward.arguments[prompt_arg]) is None:
            raise OracleError(f"the pipeline's transformer call has no row argument {prompt_arg!r} "
                              f"(PipelineSpec.prompt_arg); its arguments: {sorted(forward.arguments)}")
        value = forward.arguments[prompt_arg]
        for r in range(_count(value)):
            hits = [(branch, b) for branch, ref in references.items() for b in range(len(ref))
                    if _same(value[r], ref[b])]
            if len(hits) != 1:
                raise OracleError(f"row {r} of the pipeline's {prompt_arg!r} matches {len(hits)} rows of "
                                  f"{PROMPT_KEY} / {NEGATIVE_KEY}; expected exactly one (prompts must differ)")
            where[hits[0]] = (index, r)
    missing = [key for key in order if key not in where]
    if missing:
        raise OracleError(f"the pipeline's forwards carry no rows for {missing}")
    counts = [_count(f.arguments[prompt_arg]) for f in step.forwards]
    row_names = [name for name in step.forwards[0].arguments
                 if all(_count(f.arguments.get(name)) == n for f, n in zip(step.forwards, counts, strict=True))]

    def pick(name: str) -> Any:
        return _gathered(step.forwards[0].arguments[name],
                         [step.forwards[where[key][0]].arguments[name][where[key][1]] for key in order])

    output = _gathered(step.forwards[0].output, [step.forwards[where[key][0]].output[where[key][1]] for key in order])
    shared = {k: v for k, v in step.forwards[0].arguments.items() if k not in row_names}
    return AlignedStep(order, {name: pick(name) for name in row_names}, shared, output)


def align_family(family: ReplayFamily, step: PipelineStep, prompts: Prompts,
                 order: list[tuple[str, int]]) -> AlignedStep:
    """``align`` for a registered family: its own oracle's alignment when it brings one."""
    spec = family.pipeline
    if spec is not None and spec.oracle is not None:
        return spec.own_oracle().align(step, prompts, order)
    if spec is None:
        raise OracleError(f"replay family {family.name!r} registers no pipeline (ReplayFamily.pipeline)")
    return align(step, prompts, spec.prompt_arg, order)


def relative_error(actual: Any, expected: Any) -> torch.Tensor:
    """|actual - expected| per element over the local magnitude (max |expected| of its row), fp64. Either side may
    be a list of per-row tensors: rows of one shape are stacked; ragged rows are flattened, each padded with zero
    errors to the longest row (``[N, elements]``)."""
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        mine, theirs = row_list(actual), row_list(expected)
        if len(mine) != len(theirs):
            raise OracleError(f"{len(mine)} rows and {len(theirs)} rows differ")
        shapes = [(tuple(a.shape), tuple(e.shape)) for a, e in zip(mine, theirs, strict=True)]
        unequal = [f"row {r}: {a} vs {e}" for r, (a, e) in enumerate(shapes) if a != e]
        if unequal:
            raise OracleError(f"shapes differ ({'; '.join(unequal)})")
        if len({a for a, _ in shapes}) == 1:
            return relative_error(torch.stack(mine), torch.stack(theirs))
        flat = [relative_error(a[None], e[None]).flatten() for a, e in zip(mine, theirs, strict=True)]
        width = max(row.numel() for row in flat)
        return torch.stack([torch.nn.functional.pad(row, (0, width - row.numel())) for row in flat])
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        raise OracleError(f"shapes {tuple(a.shape)} and {tuple(e.shape)} differ")
    scale = e.abs().flatten(1).amax(dim=1).reshape(-1, *([1] * (e.dim() - 1)))
    diff = (a - e).abs()
    return torch.where(scale > 0, diff / scale, torch.where(diff > 0, torch.inf, 0.0))


SIGN_FLIP_ROOM = 1e-3  # how far from the exact negation a sign flip may sit: rounding plus a step's floor


def sign_flipped(actual: Any, expected: Any) -> bool:
    """True when ``actual`` is ``-expected`` to within SIGN_FLIP_ROOM of each row's magnitude, ``expected`` not
    zero: a relative error of 2, the signature of a sign the pipeline applies and the family does not."""
    try:
        negated = relative_error(_negated(actual), expected)
    except OracleError:  # another shape: not a sign
        return False
    if not any(bool((row != 0).any()) for row in row_list(expected)):
        return False
    return bool((negated <= SIGN_FLIP_ROOM).all())


SIGN_FLIP = ("is the exact negation of the pipeline's (relative error 2): a sign flip. The pipeline post-processes "
             "the model output (e.g. noise_pred = -noise_pred) and the family's ModelAdapter.velocity does not; "
             "declare the pipeline's transform there")


def _within(what: str, actual: Any, expected: Any, floor: StockFloor, allowance: float, reason: str,
            rows: Sequence[str] | None = None) -> Verdict:
    """Relative error within K_OUTPUT x the floor (never below RESOLUTION) plus ``allowance``, the bound held
    within [K_MIN, K_MAX] x the floor and the floor under its ceiling. A sign flip is named first; ``rows`` names
    each row where the worst element is located (default: its index)."""
    flipped = sign_flipped(actual, expected)
    lead = holds(not flipped, f"{what}: not a sign flip of the pipeline's",
                 **({"sign_flip": f"{what} {SIGN_FLIP}"} if flipped else {}))
    policy = noise_floor(floor.value, k=K_OUTPUT, floor=allowance,
                         reason=f"{reason}: {floor.describe()}; plus {allowance:.2e}, what the timestep's allowed "
                                "difference does to it")
    rel = relative_error(actual, expected)
    labels = {"row": list(rows)} if rows is not None else None
    verdict = policy.judge(rel, torch.zeros_like(rel), dims=("row",), labels=labels, what=f"{what} (relative)")
    if flipped:  # a floor measured against a negated reference is the sign, not rounding: the flip is the cause
        return lead.merge(verdict.require_bounded(K_OUTPUT * floor.value, floor.value, k_min=K_MIN, k_max=K_MAX,
                                                  what=f"{what} bound"))
    return verdict.require_bounded(K_OUTPUT * floor.value, floor, k_min=K_MIN, k_max=K_MAX, what=f"{what} bound")


COMBINE_POLICY = (f"relative error <= {K_OUTPUT:g} x {RESOLUTION / FP32_EPS:g} fp32 ulps of the local magnitude (the "
                  "same elementwise arithmetic on the same branch outputs); a relative error of exactly 2 is named "
                  "a sign flip")


def judge_combine(what: str, actual: torch.Tensor, expected: torch.Tensor, reason: str,
                  declared: str | None = None) -> Verdict:
    """The family's combine and velocity of branch outputs the pipeline computed, against what the pipeline handed
    its scheduler: no model runs, so only RESOLUTION of rounding (and never a sign) may differ. A failure that is
    not a sign flip names the ``declared`` combine and the samples where the two differ."""
    floor = _rounding_floor(0.0, 1, "the pipeline's own branch outputs: no model runs")
    samples = [f"sample {b}" for b in range(int(actual.shape[0]))]
    verdict = _within(what, actual, expected, floor, 0.0, reason, rows=samples)
    if verdict.passed or sign_flipped(actual, expected) or declared is None:
        return verdict
    bound = K_OUTPUT * floor.value
    worst = relative_error(actual, expected).flatten(1).amax(dim=1)
    differ = [name for name, error in zip(samples, worst.tolist(), strict=True) if not error <= bound]
    return verdict.require(False, f"{what}: the family's declared CFG combine ({declared}) gives the prediction the "
                                  "pipeline handed its scheduler", samples_differing=", ".join(differ),
                           declared_combine=declared)


def _rounding_floor(measured: float, terms: int, source: str, dtype: torch.dtype = torch.float32) -> StockFloor:
    """A relative floor (magnitude 1) of RESOLUTION's ulps of ``dtype``, its ceiling a reduction of ``terms`` terms."""
    return StockFloor(measured, 1.0, RESOLUTION / FP32_EPS, dtype=dtype, source=source,
                      ceiling_ulps=max(reduction_ceiling_ulps(terms), RESOLUTION / FP32_EPS),
                      ceiling_reason=f"K = {terms}: the transformer's Linear/Conv fan-ins and the tokens it attends "
                                     "over")


def to_replay(adapter: ModelAdapter, transformer_out: Any) -> torch.Tensor:
    """Transformer outputs (rows in the adapter's order, a tensor or a list of per-row tensors) in replay's layout,
    through the adapter's ``from_pipeline_latents``; a learned-sigma head's second half of the channels is cut, as
    the pipelines cut it."""
    out = adapter.from_pipeline_latents(transformer_out)
    if not isinstance(out, torch.Tensor):
        raise OracleError(f"{type(adapter).__name__}.from_pipeline_latents returned {type(out).__name__}: it receives "
                          f"the transformer's outputs as the transformer returns them (here {_shape(transformer_out)})"
                          " and returns them as one tensor [N, *latent_shape]")
    channels = adapter.latent_shape[0]
    if out.shape[1] == 2 * channels:  # replay's layout is channels-first: (B, C, ...)
        out = out[:, :channels]
    return out


def _combined(adapter: ModelAdapter, out: Any, order: list[tuple[str, int]], guidance: float,
              x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The family's combine of the cond and uncond rows of ``out`` (transformer outputs, rows in ``order``), then
    its velocity transform at latents ``x`` and per-row ``sigma``: what the scheduler steps on, in replay layout.
    It goes through the same seams as ``predict_velocity`` (``combine_branches``, ``model_velocity``)."""
    branch = {key: i for i, key in enumerate(order)}
    batch = len(order) // 2
    rows = to_replay(adapter, out)
    cond = rows[[branch[("cond", b)] for b in range(batch)]]
    uncond = rows[[branch[("uncond", b)] for b in range(batch)]]
    return denoiser.model_velocity(adapter, denoiser.combine_branches(adapter, cond, uncond, guidance), x, sigma)


def _forward_output(adapter: ModelAdapter, arguments: Mapping[str, Any]) -> Any:
    with torch.no_grad(), record_forwards(adapter.module) as calls:
        adapter.module(**arguments)
    return calls[0].output


def _control_outputs(adapter: ModelAdapter, aligned: AlignedStep, timestep_arg: str,
                     timestep: torch.Tensor) -> tuple[Any, Any]:
    """The transformer on the pipeline's own inputs in one forward of the adapter's rows and positions: at the
    pipeline's timestep (the floor: only the grouping of rows differs from the pipeline's calls) and at the
    adapter's ``timestep`` (against the first, what the timestep's allowed difference does)."""
    inputs = {**aligned.shared, **aligned.rows}
    at_pipeline = _forward_output(adapter, inputs)
    same = torch.equal(torch.as_tensor(timestep).expand_as(aligned.rows[timestep_arg]).to(
        aligned.rows[timestep_arg].dtype), aligned.rows[timestep_arg])
    at_adapter = at_pipeline if same else _forward_output(adapter, {**inputs, timestep_arg: timestep})
    return at_pipeline, at_adapter


def _tokens(aligned: AlignedStep, prompt_arg: str, adapter: ModelAdapter) -> int:
    """The tokens one attention may reduce over: the prompt's plus the latent grid's positions (an upper count:
    a patchified grid has fewer, which only raises the ceiling)."""
    prompt = aligned.rows[prompt_arg]
    if isinstance(prompt, torch.Tensor):
        text = int(prompt.shape[1]) if prompt.dim() > 2 else 0
    else:  # one item per row, [tokens, channels] each (ragged captions): the longest
        text = max((int(item.shape[0]) for item in prompt if isinstance(item, torch.Tensor) and item.dim() > 1),
                   default=0)
    height, width = adapter.latent_size
    return text + height * width


def judge_step(family: ReplayFamily, adapter: ModelAdapter, step: PipelineStep, prompts: Prompts,
               guidance: float, label: str) -> Verdict:
    """The adapter's denoiser at the step's latents and sigma against what the pipeline did at that step."""
    spec = family.pipeline
    conditions = adapter.conditions_from_prompts(prompts, 2)
    batch = conditions.batch
    x = adapter.from_pipeline_latents(step.latents)
    with torch.no_grad(), record_forwards(adapter.module) as calls:
        velocity = denoiser.predict_velocity(adapter, x, step.sigma.expand(batch), conditions, guidance)
    rows = [_count(c.arguments.get(spec.prompt_arg)) for c in calls]
    ran = holds(rows == [2 * batch], f"{label}: the denoiser ran one forward of both CFG branches "
                                    f"({2 * batch} rows)", forwards=str(rows))
    if not ran.passed:
        return ran
    mine = calls[0]
    order = adapter_order(denoiser.declared_layout(adapter), batch)
    names = [f"{branch}[{b}]" for branch, b in order]
    aligned = align(step, prompts, spec.prompt_arg, order)
    crossed = _branch_crossings(mine.arguments[spec.prompt_arg], aligned.rows[spec.prompt_arg], order)
    mismatched = _input_mismatches(mine, aligned, spec.timestep_arg, order)
    t_pipe = aligned.rows[spec.timestep_arg].double()
    t_mine = torch.as_tensor(mine.arguments[spec.timestep_arg]).expand_as(t_pipe)  # judged in fp64
    scale = float(t_pipe.abs().max())
    verdict = close(atol=TIMESTEP_ULPS * FP32_EPS * scale, rtol=0.0,
                    reason=f"timestep in the pipeline's units: within {TIMESTEP_ULPS:g} fp32 ulps of its "
                           f"magnitude {scale:.4g}").judge(t_mine, t_pipe, dims=("row",), labels={"row": names},
                                                           what=f"{label} timestep")
    crossing = f"; {', '.join(crossed)}" if crossed else ""  # a violated fact says where it was violated
    differing = "".join(f"; {name}: {how}" for name, how in mismatched.items())
    verdict = verdict.require(not crossed, f"{label}: CFG order: the rows the adapter declares cond carry the "
                                           f"pipeline's prompt, the uncond rows its negative prompt{crossing}",
                              cfg_order_backwards=len(crossed) == len(order), cfg_order_crossed=", ".join(crossed))
    verdict = verdict.require(not mismatched, f"{label}: every other transformer input equals the pipeline's, "
                                              f"row by row{differing}",
                              **{f"input_{k}": v for k, v in mismatched.items()})
    at_pipeline, at_adapter = _control_outputs(adapter, aligned, spec.timestep_arg,
                                               torch.as_tensor(mine.arguments[spec.timestep_arg]))
    terms = module_reduction_terms(adapter.module, sequence=_tokens(aligned, spec.prompt_arg, adapter))
    sigmas = step.sigma.expand(batch)
    branch_floor = _rounding_floor(float(relative_error(at_pipeline, aligned.output).max()), terms,
                                   "the transformer on the pipeline's inputs, rows grouped as the adapter's forward")
    branch_allowance = float(relative_error(at_adapter, at_pipeline).max())
    reference = adapter.from_pipeline_latents(step.model_output)
    own = _combined(adapter, aligned.output, order, guidance, x, sigmas)
    at_pipeline_combined = _combined(adapter, at_pipeline, order, guidance, x, sigmas)
    # the family's combine on both sides: a combine that is not the pipeline's fails the combine part, not this floor
    combined_floor = _rounding_floor(float(relative_error(at_pipeline_combined, own).max()),
                                     terms + adapter.latent_shape[0],
                                     "the family's combine and velocity of those control outputs vs of the "
                                     "pipeline's own")
    combined_allowance = float(relative_error(_combined(adapter, at_adapter, order, guidance, x, sigmas),
                                              at_pipeline_combined).max())
    declared = denoiser.declared_combine(adapter)
    # the combine first: a sign or combine mismatch there explains a velocity that fails after it
    verdict = verdict.merge(judge_combine(f"{label} combine", own, reference,
                                          f"the family's combine ({declared}) and {adapter.velocity_transform} "
                                          "velocity of the pipeline's own branch outputs vs its combined prediction",
                                          declared=declared))
    verdict = verdict.merge(_within(f"{label} branch outputs", mine.output, aligned.output, branch_floor,
                                    branch_allowance, "each branch's transformer output vs the pipeline's", names))
    verdict = verdict.merge(_within(f"{label} velocity", velocity, reference, combined_floor, combined_allowance,
                                    "the denoiser's velocity vs the pipeline's combined prediction",
                                    [f"sample {b}" for b in range(batch)]))
    return verdict.with_metrics(**{f"{label}_timestep_pipeline": scale,
                                   f"{label}_branch_floor": branch_floor.measured,
                                   f"{label}_branch_floor_ceiling": branch_floor.ceiling,
                                   f"{label}_timestep_allowance": combined_allowance,
                                   f"{label}_velocity_floor": combined_floor.measured,
                                   "declared_combine": declared})


def _branch_crossings(mine: Any, pipeline: Any, order: list[tuple[str, int]]) -> list[str]:
    """The adapter's prompt rows that carry the OTHER branch's prompt of the pipeline: a CFG order the adapter
    declares backwards (or a branch its conditions swap), each named ``cond[b] carries uncond[b']``. A row that
    matches no pipeline row is not a branch crossing: ``_input_mismatches`` names it."""
    crossings = []
    for r, (branch, b) in enumerate(order):
        if _count(mine) != len(order) or _same(mine[r], pipeline[r]):
            continue
        hits = [(other, c) for j, (other, c) in enumerate(order) if other != branch and _same(mine[r], pipeline[j])]
        crossings += [f"{branch}[{b}] carries {other}[{c}]" for other, c in hits[:1]]
    return crossings


def _row_difference(mine: Any, pipeline: Any) -> str:
    """How one row of an argument differs from the pipeline's: its shape, or its values."""
    if isinstance(mine, torch.Tensor) and isinstance(pipeline, torch.Tensor) and mine.shape != pipeline.shape:
        return f"shape {tuple(mine.shape)} vs the pipeline's {tuple(pipeline.shape)}"
    return "values"


def _input_mismatches(mine: Forward, aligned: AlignedStep, timestep_arg: str,
                      order: list[tuple[str, int]]) -> dict[str, str]:
    """Transformer arguments (other than the timestep) where the adapter's call differs from the pipeline's: for a
    row argument, each row that differs (in the adapter's order) and how."""
    found = {}
    for name in sorted(set(mine.arguments) | set(aligned.rows) | set(aligned.shared)):
        if name == timestep_arg:
            continue
        value = mine.arguments.get(name)
        if name in aligned.rows:
            if _count(value) != len(order):
                found[name] = f"{_count(value)} rows, expected {len(order)}"
                continue
            bad = [f"{branch}[{b}] ({_row_difference(value[r], aligned.rows[name][r])})"
                   for r, (branch, b) in enumerate(order) if not _same(value[r], aligned.rows[name][r])]
            if bad:
                found[name] = "rows " + ", ".join(bad)
        elif not _same(value, aligned.shared.get(name)):
            found[name] = "differs from the pipeline's"
    return found


def judge_family(family: ReplayFamily, adapter: ModelAdapter, record: PipelineRecord) -> Verdict:
    """The pipeline's start and every recorded step, judged and merged."""
    if family.pipeline is not None and family.pipeline.oracle is not None:
        return family.pipeline.own_oracle().judge_family(family, adapter, record)
    started = adapter.from_pipeline_latents(record.steps[0].latents)
    start = holds(started.shape == record.start.shape and torch.equal(started, record.start),
                  "step 0: the pipeline stepped the replay latents it was given (the adapter's to_pipeline_latents "
                  "is the inverse of its from_pipeline_latents)", start_shape=str(tuple(started.shape)))
    verdicts = [judge_step(family, adapter, step, record.prompts, record.guidance, f"step {i}")
                for i, step in enumerate(record.steps)]
    return functools.reduce(Verdict.merge, verdicts, start)
