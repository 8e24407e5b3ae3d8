"""A causal LM whose own forward depends on its batch, outside any MoE: every dtype and mode must fail it.

The two ablations below patch the real ``Qwen3RMSNorm`` (a model layer both the stock and the fast path run): a
single-row path that computes another function at B=1, and a statistic over the whole batch. Neither lives in an
``experts`` list, so the MoE routing probe cannot see them. What must catch them is that the controls differ from
the checks only in arithmetic order: the fp32 stock prefill floor (batched vs alone) lands above its ceiling, and
the bf16 control varies the dtype only (the same B=1 computation in fp32), so the batched KL stands out against it.
The gpu tier's ar check runs on a tiny Qwen3 checkpoint on the CPU, in fp32 and bf16; the CPU tier's checks run
with a user's implementation (conformance mode) as well as with the suite's.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from fixtures.checkpoints import KINDS
from gpu import ar as gpu_ar
from harness.judging import ablation, catalogue, checks
from harness.judging.checks import CheckContext
from harness.plugins import conformance

pytestmark = pytest.mark.cpu

STOCK_BUGS = ("ar.norm_single_row_path", "ar.norm_batch_statistic")
ZOO = Path(__file__).resolve().parents[2] / "examples" / "conformance"


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("qwen3_lm")
    KINDS["qwen3_lm"](target)
    return str(target)


@contextlib.contextmanager
def _ablated(name: str):
    catalogue.load()
    with ablation.get(name).apply():
        gpu_ar.checkpoint_backend.cache_clear()
        gpu_ar.checkpoint_routing.cache_clear()
        try:
            yield
        finally:
            gpu_ar.checkpoint_backend.cache_clear()
            gpu_ar.checkpoint_routing.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gpu_check_passes_the_model_as_it_is(qwen3_checkpoint: str, dtype: torch.dtype) -> None:
    gpu_ar.checkpoint_backend.cache_clear()
    verdict = gpu_ar.ar_check(CheckContext(dtype=dtype, checkpoint=qwen3_checkpoint))
    assert verdict.passed, verdict.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bug", STOCK_BUGS)
def test_a_batch_dependent_model_fails_the_gpu_check_in_both_dtypes(qwen3_checkpoint: str, bug: str,
                                                                     dtype: torch.dtype) -> None:
    with _ablated(bug):
        verdict = gpu_ar.ar_check(CheckContext(dtype=dtype, checkpoint=qwen3_checkpoint))
    assert not verdict.passed, verdict.describe()
    assert verdict.metrics["moe_layers"] == 0  # the routing probe had nothing to look at: the controls caught it
    if dtype == torch.float32:
        assert any("the stock path itself depends on the batch composition" in f for f in verdict.violated_facts)
    else:  # the dtype control is B=1 on both sides: the bug cannot widen it
        assert verdict.metrics["floor_measured"] <= verdict.metrics["floor_ceiling"]
        assert max(verdict.metrics["kl_per_row"]) > verdict.metrics["bound"], verdict.describe()


@pytest.mark.parametrize("bug", STOCK_BUGS)
def test_a_batch_dependent_model_fails_in_conformance_mode(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ZOO))
    catalogue.load()
    check_id = "ar.qwen3.unequal_real_pos.logp"
    with conformance.applied({"ar": "zoo_ar:fast_rollout"}):
        before = conformance.calls("ar")
        assert checks.run_check(check_id, CheckContext()).passed
        with ablation.get(bug).apply():
            verdict = checks.run_check(check_id, CheckContext())
        assert conformance.calls("ar") > before, "the user's implementation was never called"
    assert not verdict.passed
    assert any("the stock path itself depends on the batch composition" in f for f in verdict.violated_facts)
    sys.modules.pop("zoo_ar", None)
