"""GPU tier of attention: the structured-mask kernels on real captures, fp32 and bf16, at block 128 and 64, on every
capture file of the phase and every row of each, each row at its own layout (harness.attention.rows: the one recorded
beside it, else its mask's); a failing one is named by file and row.

fp32: each kernel within 4 x masked SDPA's own fp32-vs-fp64 error on the same capture (the CPU
tier's policy). Low precision: per query row, within k x the worst relative error that stock masked
SDPA in that dtype makes against the fp64 truth, scaled by the row's own magnitude
(``harness.attention.policies.low_precision_policy``); a missed or extra key moves a row far past that.
"""

from __future__ import annotations

import functools

import torch

from harness.attention.capture import Capture, load_capture, phase_captures
from harness.attention.contract import mask_mismatches
from harness.attention.judge import compare_kernel
from harness.attention.layout import AttentionLayout
from harness.attention.masks import build_mask
from harness.attention.policies import floor_control, floor_policy, in_dtype, low_precision_policy, reference_output
from harness.attention.rows import capture_rows
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict, holds

__all__ = ["KERNELS", "PHASES", "POLICY", "kernel_check"]

# kernel, or kernel.block<N> for a block-tiled kernel at another block size than the seed's 128
KERNELS = ("decomposed", "flex", "block_padded", "flex.block64", "block_padded.block64")
PHASES = ("prefill", "denoise")
POLICY = ("fp32: noise_floor(max|d| <= k x the reference's fp32-vs-fp64 error on the capture); bf16/fp16: "
          "row-scaled floor of stock masked SDPA in the dtype vs fp64")


@functools.cache
def _rows(directory: str, phase: str, device: str) -> tuple[tuple[Capture, AttentionLayout | None, str], ...]:
    """Every row of every ``phase`` capture: (the row on ``device``, its layout, why no layout fits it or "": none
    reads its mask, it admits keys past its own, or its layout's mask is not its own)."""
    found = []
    for path in phase_captures(directory, phase):
        for row in capture_rows(load_capture(path)):
            problem = row.problem or (f"its mask admits {row.past_keys} pairs past its keys" if row.past_keys else "")
            if not problem:  # a kernel judged at a layout whose mask is not the capture's judges nothing
                bad, first = mask_mismatches(build_mask(row.layout), row.capture.mask)
                problem = f"its mask differs from its layout's at {bad} pairs, first {first}" if bad else ""
            found.append((row.capture.to(device), None if problem else row.layout, problem))
    return tuple(found)


def _kernel_and_block(name: str) -> tuple[str, int]:
    kernel, _, block = name.partition(".block")
    return kernel, int(block) if block else 128


@functools.cache
def _reference(directory: str, phase: str, device: str, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Masked SDPA of one row in ``dtype`` (fp32: the fp32 reference; fp64: the truth), computed once per row."""
    return reference_output(_rows(directory, phase, device)[index][0], dtype)


@functools.cache
def _low_precision(directory: str, phase: str, device: str, index: int, dtype: torch.dtype):
    """The row-scaled policy of one row and dtype, measured once (stock masked SDPA in ``dtype`` vs fp64)."""
    capture = _rows(directory, phase, device)[index][0]
    return low_precision_policy(capture, dtype, _reference(directory, phase, device, index, torch.float64))


def _row_check(kernel: str, block: int, where: tuple[str, str, str, int], dtype: torch.dtype) -> Verdict:
    capture, layout, problem = _rows(*where[:3])[where[3]]
    if layout is None:
        return holds(False, f"{capture.name}: a structured layout fits it (see its capture's contract)",
                     layout_problem=problem)
    if dtype == torch.float32:
        reference = _reference(*where, torch.float32)
        control = floor_control(capture, reference)
        return compare_kernel(kernel, capture, floor_policy(control), block=block, layout=layout, expected=reference,
                              floor=control)
    return compare_kernel(kernel, in_dtype(capture, dtype), _low_precision(*where, dtype), block=block, layout=layout,
                          expected=_reference(*where, torch.float64))


def kernel_check(kernel: str, phase: str, ctx: CheckContext) -> Verdict:
    """``kernel`` against masked SDPA on every row of the capture directory's ``phase`` captures, in ctx.dtype."""
    directory, device = str(ctx.checkpoint), str(ctx.device)
    kernel, block = _kernel_and_block(kernel)
    count = len(_rows(directory, phase, device))
    verdict = functools.reduce(Verdict.merge, (_row_check(kernel, block, (directory, phase, device, i), ctx.dtype)
                                               for i in range(count)))
    return verdict.with_metrics(captures_judged=count)
