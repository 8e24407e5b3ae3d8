"""The gpu tier: one item per (registered gpu check, checkpoint of the kind it needs, dtype).

Without CUDA (and without --device cpu) or without --checkpoint every item is skipped with a reason
(harness.plugin); with them, each check runs on real weights and lands in the parity report. Kill items: every
ablation claiming the check, plus those the checkpoint's kind claims on it (gpu.checks.kind_kills).
"""

from pathlib import Path

import pytest
import torch

from gpu.decode import world_size as gpu_world_size
from harness import ablation, catalogue, checks
from harness.plugin import SESSION_KEY, gpu_device, parse_dtypes

catalogue.load()

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cases(config) -> list:
    """(check id, checkpoint path, dtype) per matching checkpoint and dtype; placeholders without checkpoints."""
    given = config.stash[SESSION_KEY].checkpoints
    dtypes = parse_dtypes(config.getoption("dtype"))
    cases = []
    for check in checks.all_checks("gpu"):
        matching = [c for c in given if c.feeds == check.path]
        if not given:  # nothing to run on: one item per check, skipped by the plugin with a reason
            cases.append(pytest.param((check.id, None, None), id=check.id))
        for checkpoint in matching:
            for dtype in dtypes:
                label = f"{check.id}[{checkpoint.name}-{DTYPE_NAMES[dtype]}]"
                cases.append(pytest.param((check.id, str(checkpoint.path), dtype), id=label))
    return cases


def pytest_generate_tests(metafunc):
    if "gpu_case" in metafunc.fixturenames:
        metafunc.parametrize("gpu_case", _cases(metafunc.config))
    if "gpu_kill" in metafunc.fixturenames:
        from gpu.checks import kind_kills  # registered by catalogue.load() above

        kinds = {str(c.path): c.kind for c in metafunc.config.stash[SESSION_KEY].checkpoints}
        kills = []
        for case in _cases(metafunc.config):
            check_id, checkpoint, _ = case.values[0]
            claimed = [item.name for item in ablation.all_ablations() if check_id in item.kills]
            claimed += [name for name in kind_kills(kinds.get(checkpoint, ""), check_id) if name not in claimed]
            kills += [pytest.param((name, *case.values[0]), id=f"{name}->{case.id}") for name in claimed]
        metafunc.parametrize("gpu_kill", kills)


def _label(check_id: str, checkpoint: str, dtype: torch.dtype) -> str:
    return f"{check_id}[{Path(checkpoint).name}-{DTYPE_NAMES[dtype]}]"


@pytest.mark.gpu
def test_gpu_check(gpu_case, parity_session, request):
    check_id, checkpoint, dtype = gpu_case
    ctx = parity_session.context(gpu_device(request.config), dtype, checkpoint)
    verdict = parity_session.check(check_id, ctx, label=_label(check_id, checkpoint, dtype))
    assert verdict.passed, verdict.describe()


@pytest.mark.gpu
def test_gpu_ablation_kills_check(gpu_kill, parity_session, request):
    """The gpu checks have teeth on real weights too: each claimed ablation must make them fail."""
    name, check_id, checkpoint, dtype = gpu_kill
    ctx = parity_session.context(gpu_device(request.config), dtype, checkpoint)
    label = _label(check_id, checkpoint, dtype)
    baseline = parity_session.check(check_id, ctx, label=label)
    assert baseline.passed, f"{label} must pass without {name} first:\n{baseline.describe()}"
    if check_id.startswith("decode.") and gpu_world_size(ctx) < 2:
        pytest.skip("one rank: the sharded decode has no second rank here, so only the stock gate is checked")
    result = parity_session.kill(name, check_id, ctx, label=label)
    assert result.killed, f"{name} ({ablation.get(name).why}) did not kill {label}: {result.how}\n{result.detail}"
