"""Hand-written expectations shared by the compare tests: the metric dict every policy reports, the NaN/Inf
message and float32 bit patterns (read through struct, independently of the harness)."""

import struct
from typing import Any

NAN_MESSAGE = "output: non-finite values (actual {}, expected {}); NaN/Inf never pass"


def base_metrics(max_abs: Any, mismatched: int, total: int, rel_l2: Any, nonfinite: int = 0, **extra: Any) -> dict:
    """The metric dict a policy reports, in its order, plus the policy's own entries."""
    return {"max_abs": max_abs, "mismatched": mismatched, "total": total, "rel_l2": rel_l2, "nonfinite": nonfinite,
            **extra}


def f32_bits(value: float) -> int:
    """The IEEE float32 bit pattern of ``value`` as a signed int32."""
    return struct.unpack("<i", struct.pack("<f", value))[0]
