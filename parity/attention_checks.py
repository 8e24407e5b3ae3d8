"""Parity checks of the attention path (registered into harness.judging.checks).

Contract checks judge the harness's mask builder on the seed layouts against the seed's formula
and numbers. Capture checks read capture files (``ctx.capture_dir``, the plugin's --capture-dir;
without it the synthetic seed captures written to a temp dir in the seed's npz format): every file of
the phase and every row of each (harness.attention.rows: a row at the layout recorded beside it, else
read from its mask), a failing one named by file and row. Kernel checks run each kernel on the seed's
exact Q/KV lengths (with --capture-dir: on every row of every file of the phase) against masked SDPA on
the capture's mask (1 head on CPU, all 8 on CUDA; see fixtures.attention_captures), under a noise-floor
policy measured on that capture. The block-tiled kernels (flex, block_padded) run at the seed's 128 and again at 64
(``attention.{phase}.{kernel}.block64.vs_sdpa``): numbers and launch proofs at each block size. A kernel
check runs only on a capture whose mask its detected layout reproduces (else it fails, pointing at the
capture's contract check, instead of judging against a misread layout).

Beyond the seed's shapes, ``attention.{images,aligned,bf16}.{kernel}.vs_sdpa`` and ``attention.gqa.*`` feed
every kernel the input classes of the conformance contract (fixtures.attention_captures.INPUT_CASES):
GQA with two key/value heads, several images, KV lengths that are multiples of the block, ``scale=None``,
bf16. Under ``--impl attention=MOD:FN`` every kernel check judges the user's kernel; the contract and
capture checks and the mask-free detection judge the suite's mask builder and reference only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fixtures import attention_captures as seeds
from harness.attention import capture as capture_io
from harness.attention import contract, judge, kernels, masks, rows
from harness.attention.layout import PHASES
from harness.judging import floors, space
from harness.judging.checkid import CheckId
from harness.judging.checks import CheckContext, register
from harness.judging.compare import UNSTAMPED, Verdict, holds
from harness.plugins import conformance

# The attention handoff's numbers (docs/contracts.md): densities to 4 decimals, prefill pair counts, and the
# denoise row-visibility histogram.
SEED_DENSITY = {"prefill": 0.7933, "denoise": 0.9994}
SEED_PREFILL_PAIRS = 14_303_226 + 8_386_560  # causal base + image-span block
SEED_DENOISE_HISTOGRAM = {1247: 1, 1248: 1, 1249: 1, 5345: 4096}
FAST_KERNELS = kernels.kernels_under_test()  # every registered kernel under test: shipped, then installed
OTHER_BLOCK = 64  # the seed's kernels tile at 128 (the default); the block-tiled ones are checked at 64 too
# (phase, kernel) checked at OTHER_BLOCK on the CPU: block_padded on denoise, whose lengths pad differently
# at 64 and 128 (4160 x 5376 vs 4224 x 5376; prefill's 5348 pads to 5376 at both). Eager flex on the
# CPU computes every pair whatever the block (~3-4 s per seed-shaped call), so flex at 64 is checked on
# small layouts (tests/attention/test_registry.py, test_bf16.py) and at the seed shapes by
# the GPU tier, which runs every kernel and phase at both blocks.
OTHER_BLOCK_CASES = (("denoise", "block_padded"),)
# The mask-free approximation must miss by orders of magnitude, not by rounding: its error must be
# >= 1000 x the noise-floor bound (measured: ~3e5 x at prefill, ~7e5 x at denoise).
MASK_FREE_MIN_MARGIN = 1e3
KERNEL_POLICY = ("noise_floor(max|d| and rel L2 each <= 4 x the reference's own fp32-vs-fp64 error on the "
                 "capture; bf16 inputs: row-scaled)")
CONTRACT_POLICY = "fact: the suite's mask builder against the seed's formula and numbers"
MASK_FREE = CheckId("attention", "", "mask_free", "detected")
READS_CAPTURE = ("capture_dir",)  # checks on the seed phases' captures: --capture-dir's files when given


@dataclass(frozen=True)
class KernelCase:
    """One kernel against masked SDPA on one input: a seed phase, the GQA layout or a conformance input class,
    at the kernel's default block or, with ``block``, at that block only."""

    inputs: str  # a phase, "gqa" or an input case name
    kernel: str
    block: int = 0

    @property
    def check_id(self) -> CheckId:
        block = f".block{self.block}" if self.block else ""
        return CheckId("attention", self.inputs, f"{self.kernel}{block}", "vs_sdpa")


def contract_id(phase: str, what: str) -> CheckId:
    return CheckId("attention", "contract", phase, what)


def capture_id(phase: str) -> CheckId:
    return CheckId("attention", "capture", phase, "contract")


def _device(ctx: CheckContext) -> str:
    return str(ctx.device)


def _inputs(ctx: CheckContext, phase: str) -> tuple[seeds.PhaseInputs, ...]:
    """Every capture row of ``phase`` the checks judge (the synthetic seed capture without --capture-dir)."""
    return seeds.capture_inputs(ctx.capture_dir, phase, _device(ctx))


def _each(inputs: tuple[seeds.PhaseInputs, ...], judge_one) -> Verdict:
    """One verdict over every capture row: each judged, all must pass, the worst leads."""
    verdict = functools.reduce(Verdict.merge, (judge_one(one) for one in inputs))
    return verdict if len(inputs) == 1 else verdict.with_metrics(captures_judged=len(inputs))


# ------------------------------------------------------------------------------------- contract


def _seed_report(phase: str) -> contract.ContractReport:
    """The verifier's report on the builder's mask for the seed layout (built fresh: seams are live)."""
    layout = seeds.SEED_LAYOUTS[phase]
    return contract.verify_mask(masks.build_mask(layout), layout.span)


def _mismatches(phase: str) -> Verdict:
    return judge.formula_verdict(_seed_report(phase))


def _density(phase: str) -> Verdict:
    report = _seed_report(phase)
    visible = sum(count * rows for count, rows in report.histogram.items())
    verdict = holds(round(report.density, 4) == SEED_DENSITY[phase],
                    f"density rounds to the seed's {SEED_DENSITY[phase]:.4f}", density=report.density,
                    visible_pairs=visible, pairs=report.total)
    if phase == "prefill":
        verdict = verdict.require(visible == SEED_PREFILL_PAIRS,
                                  f"visible pairs = the seed's causal base + span block = {SEED_PREFILL_PAIRS:,}")
    return verdict


def _span(phase: str) -> Verdict:
    layout = seeds.SEED_LAYOUTS[phase]
    fact = f"span detection recovers {layout.describe()}"
    try:
        report = _seed_report(phase)
        detected = contract.layout_for(report.q_len, report.kv_len, report.detected_span).describe()
    except ValueError as err:  # the mask left the structured family: a failed check, not a crash
        return holds(False, fact, detected=f"none ({err})")
    return holds(detected == layout.describe(), fact, detected=detected)


@register(contract_id("denoise", "histogram"), policy=CONTRACT_POLICY)
def denoise_histogram() -> Verdict:
    """The denoise row-visibility histogram is exactly the seed's."""
    histogram = _seed_report("denoise").histogram
    return holds(histogram == SEED_DENOISE_HISTOGRAM,
                 f"row-visibility histogram == {SEED_DENOISE_HISTOGRAM}", histogram=str(histogram))


for _phase in PHASES:
    register(contract_id(_phase, "mismatches"), policy=CONTRACT_POLICY,
             doc=f"build_mask of the seed {_phase} layout agrees with the formula elementwise")(
        functools.partial(_mismatches, _phase))
    register(contract_id(_phase, "density"), policy=CONTRACT_POLICY, doc=f"seed {_phase} mask density to 4 decimals")(
        functools.partial(_density, _phase))
    register(contract_id(_phase, "span"), policy=CONTRACT_POLICY, doc=f"span detection on the seed {_phase} mask")(
        functools.partial(_span, _phase))


# -------------------------------------------------------------------------------------- capture


def _capture_contract(phase: str, ctx: CheckContext) -> Verdict:
    """Every capture file of ``phase`` follows the contract, row by row, and the mask builder reproduces each row.

    A row is judged at the spans recorded beside it when the file holds them (harness.attention.rows), else at the
    spans its mask shows. Without --capture-dir the synthetic seed capture goes through the seed's file format and
    must come back bit for bit, with the seed's layout detected.
    """
    directory = ctx.capture_dir or str(seeds.seed_capture_dir())
    paths = capture_io.phase_captures(directory, phase)
    captured = [rows.capture_rows(capture_io.load_capture(path)) for path in paths]
    verdict = functools.reduce(Verdict.merge, (rows.row_contract(row) for found in captured for row in found))
    first = captured[0][0]
    histogram = contract.visibility_histogram(first.capture.mask)
    verdict = verdict.with_metrics(files=len(paths), rows=sum(map(len, captured)), file=paths[0].name,
                                   layout=first.layout.describe() if first.layout else "none",
                                   histogram=str(histogram) if len(histogram) <= 8 else
                                   f"{len(histogram)} distinct counts", q_len=first.capture.q_len,
                                   kv_len=first.capture.kv_len)
    if ctx.capture_dir is None:
        written, loaded = seeds.seed_capture(phase), capture_io.load_capture(paths[0])
        same = all(getattr(written, name).equal(getattr(loaded, name)) for name in capture_io.CAPTURE_ARRAYS)
        verdict = verdict.require(same, "the npz round trip returns query/key/value/mask bit for bit")
        verdict = verdict.require(first.layout == seeds.SEED_LAYOUTS[phase], "the seed layout is detected in the file",
                                  detected=first.layout.describe() if first.layout else "none")
    return verdict


for _phase in PHASES:
    register(capture_id(_phase), policy="fact: the capture file follows the contract; the builder reproduces its mask",
             doc=f"{_phase} capture file: contract + builder reproduce it", reads=READS_CAPTURE)(
        functools.partial(_capture_contract, _phase))


# -------------------------------------------------------------------------------------- kernels


def _compare(kernel: str, inputs: seeds.PhaseInputs, block: int = kernels.BLOCK) -> Verdict:
    """The kernel policy: max|d| and relative L2 each within 4 x the reference's own fp32-vs-fp64 error."""
    if inputs.misread is not None:
        return holds(False, f"{inputs.capture.name}: its mask is its layout's (see attention.capture.*.contract)",
                     misread=inputs.misread, capture=inputs.capture.name)
    return judge.compare_kernel(kernel, inputs.capture, judge.floor_policy(inputs.control), block=block,
                                 layout=inputs.layout, expected=inputs.expected,
                                 max_rel_l2=judge.rel_l2_bound(inputs.control), floor=inputs.control)


def _kernel_vs_sdpa(phase: str, kernel: str, ctx: CheckContext) -> Verdict:
    return _each(_inputs(ctx, phase), functools.partial(_compare, kernel))


def _kernel_at_block(phase: str, kernel: str, block: int, ctx: CheckContext) -> Verdict:
    return _each(_inputs(ctx, phase), lambda inputs: _compare(kernel, inputs, block))


def _gqa_vs_sdpa(kernel: str, ctx: CheckContext) -> Verdict:
    """GQA: the kernel gets compressed key/value heads, the reference the expanded ones (synthetic
    even with --capture-dir: the seed's dumps are already expanded)."""
    inputs = seeds.gqa_inputs(_device(ctx))
    return _compare(kernel, inputs)


for _kernel in FAST_KERNELS:
    for _phase in PHASES:
        register(KernelCase(_phase, _kernel).check_id, policy=KERNEL_POLICY,
                 doc=f"{_kernel} vs masked SDPA at the seed {_phase} shapes", reads=READS_CAPTURE)(
            functools.partial(_kernel_vs_sdpa, _phase, _kernel))
    register(KernelCase("gqa", _kernel).check_id, policy=KERNEL_POLICY,
             doc=f"{_kernel} with compressed KV heads vs expanded masked SDPA")(
        functools.partial(_gqa_vs_sdpa, _kernel))

for _phase, _kernel in OTHER_BLOCK_CASES:
    register(KernelCase(_phase, _kernel, OTHER_BLOCK).check_id, policy=KERNEL_POLICY,
             doc=f"{_kernel} tiled at block {OTHER_BLOCK} vs masked SDPA at the seed {_phase} shapes",
             reads=READS_CAPTURE)(
        functools.partial(_kernel_at_block, _phase, _kernel, OTHER_BLOCK))


def _input_case(case: str, kernel: str, ctx: CheckContext) -> Verdict:
    """A kernel on one input class of the conformance contract (small layout), at the seed block and at 64."""
    inputs = seeds.case_inputs(case, _device(ctx))
    blocks = (kernels.BLOCK, OTHER_BLOCK) if kernels.get_kernel(kernel).blocked else (kernels.BLOCK,)
    verdicts = [inputs.judge(kernel, block) for block in blocks]
    return functools.reduce(Verdict.merge, verdicts).with_metrics(inputs=inputs.case.describe())


for _case in seeds.INPUT_CASES.values():
    for _kernel in FAST_KERNELS:
        register(KernelCase(_case.name, _kernel).check_id, policy=KERNEL_POLICY,
                 doc=f"{_kernel} vs masked SDPA: {_case.describe()}")(
            functools.partial(_input_case, _case.name, _kernel))


def _detection(phase: str, free: Verdict) -> Verdict:
    """A verdict that passes when ``free`` (the mask-free kernel's) fails by >= MASK_FREE_MIN_MARGIN.

    Its margin is MASK_FREE_MIN_MARGIN / the mask-free margin, so <= 1 passes like any margin.
    """
    observed = free.margin if free.margin is not None else 0.0
    passed = not free.passed and observed >= MASK_FREE_MIN_MARGIN
    margin = MASK_FREE_MIN_MARGIN / observed if observed > 0 else float("inf")
    message = "" if passed else (f"{phase}: is_causal only was not detected: its error is {observed:.3e} x the "
                                 f"kernel policy's bound, below the required {MASK_FREE_MIN_MARGIN:g} x")
    metrics = {f"{phase}_mask_free_margin": observed, f"{phase}_mask_free_max_abs": free.metrics["max_abs"],
               f"{phase}_mask_free_rel_l2": free.metrics["rel_l2"]}
    return Verdict(UNSTAMPED, passed, metrics, f"detect(mask_free error >= {MASK_FREE_MIN_MARGIN:g} x kernel bound)",
                   margin, headline=f"{phase}_mask_free_margin", tolerance=MASK_FREE_MIN_MARGIN, message=message)


@register(MASK_FREE, policy=f"{KERNEL_POLICY}; detect(mask_free error >= {MASK_FREE_MIN_MARGIN:g} x kernel bound)",
          reads=READS_CAPTURE)
def mask_free_detected(ctx: CheckContext) -> Verdict:
    """Masked SDPA on the layout reproduces the capture while is_causal only misses it by far, both phases."""
    verdicts = []
    for phase in PHASES:
        for inputs in _inputs(ctx, phase):
            verdicts.append(_compare("sdpa", inputs))
            verdicts.append(_detection(phase, _compare("mask_free", inputs)))
    return functools.reduce(Verdict.merge, verdicts)


conformance.not_judged("attention.contract.*", "judges the suite's mask builder against the seed's formula; "
                                               "no kernel runs")
conformance.not_judged("attention.capture.*", "judges a capture file and the suite's mask builder; no kernel runs")
conformance.not_judged(str(MASK_FREE), "judges the suite's reference against the capture and "
                                                       "the is_causal-only negative control; no kernel under test "
                                                       "runs")

# Under --impl attention=MODULE:CALLABLE the user's one kernel stands in for every kernel name, so each input would
# be judged once per name: it is judged once, under the first name, and the other names' checks (and the other
# block size, which the documented signature does not take) are deselected, saying which check judges that input.
_JUDGED_AS = FAST_KERNELS[0]
for _input in (*PHASES, "gqa", *seeds.INPUT_CASES):
    for _kernel in FAST_KERNELS[1:]:
        conformance.not_judged(str(KernelCase(_input, _kernel).check_id),
                               f"the same input as {KernelCase(_input, _JUDGED_AS).check_id}: your one kernel "
                               "stands in for every kernel name, so it is judged once per input")
for _phase, _kernel in OTHER_BLOCK_CASES:
    conformance.not_judged(str(KernelCase(_phase, _kernel, OTHER_BLOCK).check_id),
                           f"the same input as {KernelCase(_phase, _JUDGED_AS).check_id}: your kernel takes no "
                           "block size")

floors.declare("attention.*", "1 ulp of the compared dtype at the output's magnitude (max|d|), or of 1 (rel L2)",
               "8 sqrt(K) ulps, K = the head dim plus twice the keys (q.k, the softmax's sum, the weighted sum of "
               "values); the control is the reference's own fp32-vs-fp64 error")
# where each check sits in the attention input space (harness.judging.space): the dtype its inputs arrive in
space.at("attention.*", dtype="float32")
space.at("attention.bf16.*", dtype="bfloat16")
