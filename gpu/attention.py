"""GPU tier of attention: the structured-mask kernels on real captures, fp32 and bf16.

fp32: each kernel within 4 x masked SDPA's own fp32-vs-fp64 error on the same capture (the CPU
tier's policy). bf16: each kernel run in bf16 may be at most 2 x as far from the fp32 reference as
bf16 masked SDPA is, plus one bf16 rounding step at the output's scale; a missed or extra key moves
outputs far past that.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from harness.attention.capture import Capture, load_capture, phase_capture_path
from harness.attention.parity import compare_kernel, floor_control, floor_policy, reference_output
from harness.checks import CheckContext
from harness.compare import Verdict, max_abs_diff, noise_floor

__all__ = ["BF16_K", "KERNELS", "PHASES", "kernel_check"]

KERNELS = ("decomposed", "flex", "block_padded")
PHASES = ("prefill", "denoise")
BF16_K = 2.0
BF16_STEP = 2.0**-8  # one bf16 rounding step relative to the output's magnitude


@functools.cache
def _capture(directory: str, phase: str, device: str) -> Capture:
    return load_capture(phase_capture_path(directory, phase)).to(device)


@functools.cache
def _reference(directory: str, phase: str, device: str) -> torch.Tensor:
    return reference_output(_capture(directory, phase, device))


def _in_dtype(capture: Capture, dtype: torch.dtype) -> Capture:
    return dataclasses.replace(capture, query=capture.query.to(dtype), key=capture.key.to(dtype),
                               value=capture.value.to(dtype), name=f"{capture.name} ({dtype})")


def kernel_check(check_id: str, kernel: str, phase: str, ctx: CheckContext) -> Verdict:
    """``kernel`` against masked SDPA on the capture directory's ``phase`` capture, in ctx.dtype."""
    directory, device = str(ctx.checkpoint), str(ctx.device)
    capture, reference = _capture(directory, phase, device), _reference(directory, phase, device)
    if ctx.dtype == torch.float32:
        return compare_kernel(kernel, capture, floor_policy(floor_control(capture, reference)), check_id,
                              expected=reference)
    low = _in_dtype(capture, ctx.dtype)
    control = max_abs_diff(reference_output(low).float(), reference)
    step = BF16_STEP * float(reference.abs().max())
    policy = noise_floor(control, k=BF16_K, floor=step,
                         reason=f"{ctx.dtype} masked SDPA vs the fp32 reference on the same capture, "
                                f"plus one rounding step ({step:.2e})")
    return compare_kernel(kernel, low, policy, check_id, expected=reference)
