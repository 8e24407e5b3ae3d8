"""GPU-tier checks (tier "gpu"): the paths' comparisons on real checkpoints, per dtype.

Each check runs against ``ctx.checkpoint`` of the kind its path is fed by (harness.inputs.checkpoints.KINDS)
and ``ctx.dtype``; gpu/test_gpu.py generates one item per (check, matching checkpoint, dtype), and one kill item per
ablation that claims the check or that the checkpoint's kind claims on it (``kind_kills``).
"""

from __future__ import annotations

import functools

from gpu import ar, attention, decode, replay
from harness.judging.checkid import CheckId
from harness.judging.checks import register
from harness.judging.compare import exact

__all__ = ["KIND_ALSO_FEEDS", "KIND_KILLS", "also_feeds", "checkpoint_labels", "kind_kills"]

#: checkpoint kind -> check id -> ablations that kill the check on that kind beyond the check's own claimants
KIND_KILLS: dict[str, dict[str, tuple[str, ...]]] = {**ar.KIND_KILLS}
#: checkpoint kind -> the other paths its checkpoints feed: a HunyuanImage-3 checkpoint is an ar model whose image
#: forward replay drives too (when its config names the image forward's latent channels)
KIND_ALSO_FEEDS: dict[str, tuple[str, ...]] = {"hunyuan_image3": replay.ALSO_FEEDS}


def checkpoint_labels(given) -> dict[str, str]:
    """What each given checkpoint is called in the report's labels (``check[label-dtype]``), by path: its kind,
    which says what ran whatever the directory is named; ``kind_1``, ``kind_2``, ... in the order given where
    several checkpoints of one kind are given."""
    kinds = [checkpoint.kind for checkpoint in given]
    labels, seen = {}, {}
    for checkpoint in given:
        seen[checkpoint.kind] = seen.get(checkpoint.kind, 0) + 1
        repeated = kinds.count(checkpoint.kind) > 1
        labels[str(checkpoint.path)] = f"{checkpoint.kind}_{seen[checkpoint.kind]}" if repeated else checkpoint.kind
    return labels


def also_feeds(checkpoint) -> tuple[str, ...]:
    """The paths a checkpoint feeds beyond its kind's own: those ``KIND_ALSO_FEEDS`` lists for its kind, each when
    the checkpoint has what that path drives (``replay.drives``: read from config.json, nothing imported)."""
    return tuple(path for path in KIND_ALSO_FEEDS.get(checkpoint.kind, ())
                 if path != "replay" or replay.drives(checkpoint))


def kind_kills(kind: str, check_id: str) -> tuple[str, ...]:
    """The ablations checkpoints of ``kind`` claim on ``check_id`` beyond the ablations that claim it everywhere."""
    return KIND_KILLS.get(kind, {}).get(check_id, ())


for _id, (_judge, _doc) in decode.GPU_CHECKS.items():
    register(_id, tier="gpu", doc=_doc, policy=exact())(_judge)

for _what in replay.GPU_CHECKS:
    register(CheckId("replay", "gpu", "cfg2", _what), tier="gpu",
             doc=f"batched vs serial replay {_what} on the real DiT",
             policy=exact() if _what == "replay_determinism" else replay.replay_policy)(
        functools.partial(replay.replay_check, _what))

register(replay.ORACLE_ID, tier="gpu", policy=replay.ORACLE_POLICY,
         doc="the family's adapter held to the checkpoint's own sampling loop (the pipeline oracle)")(
    replay.oracle_check)

register(ar.CHECK_ID, tier="gpu", doc="batched right-padded AR vs B=1 on the real causal LM", policy=ar.POLICY)(
    ar.ar_check)
register(ar.LEFT_CHECK_ID, tier="gpu", doc="batched left-padded AR vs B=1 on the real causal LM", policy=ar.POLICY)(
    ar.left_ar_check)

for _phase in attention.PHASES:
    for _kernel in attention.KERNELS:
        register(CheckId("attention", "gpu", _phase, _kernel), tier="gpu", policy=attention.POLICY,
                 doc=f"{_kernel} vs masked SDPA on the {_phase} capture")(
            functools.partial(attention.kernel_check, _kernel, _phase))
