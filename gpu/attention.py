"""GPU tier of attention: the structured-mask kernels on real captures, fp32 and bf16, at block 128 and 64.

fp32: each kernel within 4 x masked SDPA's own fp32-vs-fp64 error on the same capture (the CPU
tier's policy). Low precision: per query row, within k x the worst relative error that stock masked
SDPA in that dtype makes against the fp64 truth, scaled by the row's own magnitude
(``harness.attention.policies.low_precision_policy``); a missed or extra key moves a row far past that.
"""

from __future__ import annotations

import functools

import torch

from harness.attention.capture import Capture, load_capture, phase_capture_path
from harness.attention.judge import compare_kernel
from harness.attention.policies import (
    RowScaledFloor,
    floor_control,
    floor_policy,
    in_dtype,
    low_precision_policy,
    reference_output,
)
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict

__all__ = ["KERNELS", "PHASES", "POLICY", "kernel_check"]

# kernel, or kernel.block<N> for a block-tiled kernel at another block size than the seed's 128
KERNELS = ("decomposed", "flex", "block_padded", "flex.block64", "block_padded.block64")
PHASES = ("prefill", "denoise")
POLICY = ("fp32: noise_floor(max|d| <= k x the reference's fp32-vs-fp64 error on the capture); bf16/fp16: "
          "row-scaled floor of stock masked SDPA in the dtype vs fp64")


@functools.cache
def _capture(directory: str, phase: str, device: str) -> Capture:
    return load_capture(phase_capture_path(directory, phase)).to(device)


@functools.cache
def _reference(directory: str, phase: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    return reference_output(_capture(directory, phase, device), dtype)


@functools.cache
def _low_precision(directory: str, phase: str, device: str, dtype: torch.dtype) -> RowScaledFloor:
    """The row-scaled policy of one capture and dtype, measured once (stock masked SDPA in ``dtype`` vs fp64)."""
    truth = _reference(directory, phase, device, torch.float64)
    return low_precision_policy(_capture(directory, phase, device), dtype, truth)


def _kernel_and_block(name: str) -> tuple[str, int]:
    kernel, _, block = name.partition(".block")
    return kernel, int(block) if block else 128


def kernel_check(kernel: str, phase: str, ctx: CheckContext) -> Verdict:
    """``kernel`` against masked SDPA on the capture directory's ``phase`` capture, in ctx.dtype."""
    directory, device = str(ctx.checkpoint), str(ctx.device)
    kernel, block = _kernel_and_block(kernel)
    capture = _capture(directory, phase, device)
    if ctx.dtype == torch.float32:
        reference = _reference(directory, phase, device, torch.float32)
        control = floor_control(capture, reference)
        return compare_kernel(kernel, capture, floor_policy(control), block=block, expected=reference,
                              floor=control)
    truth = _reference(directory, phase, device, torch.float64)
    policy = _low_precision(directory, phase, device, ctx.dtype)
    return compare_kernel(kernel, in_dtype(capture, ctx.dtype), policy, block=block, expected=truth)
