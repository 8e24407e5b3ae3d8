"""Attention checks over the input space (registered into harness.judging.checks): one per drawn point.

``fixtures.attention_space.POINTS`` covers every pair of values of the attention axes (scale default or custom,
batch 1 or 2, GQA group 1, 2 or 4, KV aligned to the block or not, fp32 or bf16) plus a per-commit seeded draw;
``attention.space.<label>`` runs every kernel under test but flex (``RETRACED_PER_SHAPE``) at its point against
masked SDPA on the capture's own mask: fp32 within 4 x the reference's own error against fp64 (max|d| and relative
L2), bf16 per query row within 4 x stock bf16 masked SDPA's own relative error, each bound held to
[K_MIN, K_MAX] x its floor. Under ``--impl attention=MOD:FN`` the user's kernel stands in for every kernel name, so
each point judges it once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from fixtures import attention_captures as seeds
from fixtures import attention_space
from harness.attention import kernels
from harness.judging import space
from harness.judging.checks import CheckContext, register
from harness.judging.compare import Verdict
from harness.plugins import conformance

# flex attention runs through dynamo even eagerly (compiled on CUDA), which traces it again for every new shape and
# dtype: ~0.2 s per point on the CPU, ten times both other kernels together. The space's points are the other
# kernels' (and, under --impl, the user's); flex meets these input classes at the seed shapes, GQA, several images,
# aligned KV and bf16 (attention.*.flex.vs_sdpa).
RETRACED_PER_SHAPE = ("flex",)
SPACE_POLICY = ("noise_floor(fp32: max|d| and rel L2 each <= 4 x the reference's own fp32-vs-fp64 error on the "
                "input; bf16: per query row <= 4 x stock bf16 masked SDPA's relative error vs fp64)")


def judge_point(point: Mapping[str, str], ctx: CheckContext) -> Verdict:
    """Every kernel under test but flex (the implementation under test once, under ``--impl``) at ``point``."""
    inputs = seeds.inputs_of(attention_space.case_at(point), str(ctx.device))
    names = [name for name in kernels.kernels_under_test() if name not in RETRACED_PER_SHAPE]
    judged = names if conformance.active("attention") is None else names[:1]
    verdict = functools.reduce(Verdict.merge, (inputs.judge(name) for name in judged))
    return verdict.with_metrics(inputs=inputs.case.describe(), kernels=",".join(judged))


for _point in attention_space.POINTS:
    _id = str(attention_space.check_id(_point))
    register(_id, policy=SPACE_POLICY, doc=f"every kernel vs masked SDPA at {space.describe(_point)}")(
        functools.partial(judge_point, _point))
    space.at(_id, **_point)
