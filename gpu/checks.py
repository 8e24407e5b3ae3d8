"""GPU-tier checks (tier "gpu"): the paths' comparisons on real checkpoints, per dtype.

Each check runs against ``ctx.checkpoint`` of the kind its path is fed by (harness.checkpoints.KINDS)
and ``ctx.dtype``; gpu/test_gpu.py generates one item per (check, matching checkpoint, dtype).
"""

from __future__ import annotations

import functools

from gpu import ar, attention, decode, replay
from harness.checks import register

register("decode.gpu.bitexact", tier="gpu",
         doc="sharded decode over every visible GPU vs the stock decode: bitwise, rank SHA-256 equal")(
    functools.partial(decode.decode_bitexact, "decode.gpu.bitexact"))

for _what in replay.GPU_CHECKS:
    _id = f"replay.gpu.cfg2.{_what}"
    register(_id, tier="gpu", doc=f"batched vs serial replay {_what} on the real DiT")(
        functools.partial(replay.replay_check, _id, _what))

register("ar.gpu.batched_vs_b1", tier="gpu", doc="batched right-padded AR vs B=1 on the real causal LM")(
    functools.partial(ar.ar_check, "ar.gpu.batched_vs_b1"))

for _phase in attention.PHASES:
    for _kernel in attention.KERNELS:
        _id = f"attention.gpu.{_phase}.{_kernel}"
        register(_id, tier="gpu", doc=f"{_kernel} vs masked SDPA on the {_phase} capture")(
            functools.partial(attention.kernel_check, _id, _kernel, _phase))
