"""GPU-tier checks (tier "gpu"): the paths' comparisons on real checkpoints, per dtype.

Each check runs against ``ctx.checkpoint`` of the kind its path is fed by (harness.checkpoints.KINDS)
and ``ctx.dtype``; gpu/test_gpu.py generates one item per (check, matching checkpoint, dtype), and one kill item per
ablation that claims the check or that the checkpoint's kind claims on it (``kind_kills``).
"""

from __future__ import annotations

import functools

from gpu import ar, attention, decode, replay
from harness.checks import register

__all__ = ["KIND_KILLS", "kind_kills"]

#: checkpoint kind -> check id -> ablations that kill the check on that kind beyond the check's own claimants
KIND_KILLS: dict[str, dict[str, tuple[str, ...]]] = {**ar.KIND_KILLS}


def kind_kills(kind: str, check_id: str) -> tuple[str, ...]:
    """The ablations checkpoints of ``kind`` claim on ``check_id`` beyond the ablations that claim it everywhere."""
    return KIND_KILLS.get(kind, {}).get(check_id, ())

register("decode.gpu.bitexact", tier="gpu",
         doc="sharded decode over every visible GPU vs the stock decode: bitwise, rank SHA-256 equal")(
    functools.partial(decode.decode_bitexact, "decode.gpu.bitexact"))
for _id, (_judge, _doc) in decode.GPU_CHECKS.items():
    register(_id, tier="gpu", doc=_doc)(functools.partial(_judge, _id))

for _what in replay.GPU_CHECKS:
    _id = f"replay.gpu.cfg2.{_what}"
    register(_id, tier="gpu", doc=f"batched vs serial replay {_what} on the real DiT")(
        functools.partial(replay.replay_check, _what))

register(ar.CHECK_ID, tier="gpu", doc="batched right-padded AR vs B=1 on the real causal LM")(
    functools.partial(ar.ar_check, ar.CHECK_ID))

for _phase in attention.PHASES:
    for _kernel in attention.KERNELS:
        _id = f"attention.gpu.{_phase}.{_kernel}"
        register(_id, tier="gpu", doc=f"{_kernel} vs masked SDPA on the {_phase} capture")(
            functools.partial(attention.kernel_check, _id, _kernel, _phase))
