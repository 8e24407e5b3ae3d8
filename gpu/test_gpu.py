"""The gpu tier: one item per (registered gpu check, checkpoint of the kind it needs, dtype), labelled
``check[kind-dtype]`` by the checkpoint's kind (``gpu.checks.checkpoint_labels``).

Without CUDA (and without --device cpu) or without --checkpoint every item is skipped with a reason
(harness.plugin); with them, each check runs on real weights and lands in the parity report. Kill items: every
ablation claiming the check, plus those the checkpoint's kind claims on it (gpu.checks.kind_kills).
"""

import dataclasses

import pytest
import torch

from gpu.decode import world_size as gpu_world_size
from harness.judging import ablation, catalogue, checks
from harness.judging.items import ParityItem
from harness.options import gpu_device, parse_dtypes
from harness.session import SESSION_KEY

catalogue.load()

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cases(config) -> list[ParityItem]:
    """One item per matching checkpoint and dtype; one placeholder per check without checkpoints."""
    given = config.stash[SESSION_KEY].checkpoints
    dtypes = parse_dtypes(config.getoption("dtype"))
    cases = []
    from gpu.checks import also_feeds, checkpoint_labels  # registered by catalogue.load() above

    names = checkpoint_labels(given)  # the kind, not the directory's name
    for check in checks.all_checks("gpu"):
        matching = [c for c in given if c.feeds == check.path or check.path in also_feeds(c)]
        if not given:  # nothing to run on: one item per check, skipped by the plugin with a reason
            cases.append(ParityItem(check.id))
        for checkpoint in matching:
            for dtype in dtypes:
                label = f"{check.id}[{names[str(checkpoint.path)]}-{DTYPE_NAMES[dtype]}]"
                cases.append(ParityItem(check.id, label=label, checkpoint=str(checkpoint.path), dtype=dtype))
    return cases


def pytest_generate_tests(metafunc):
    if "gpu_case" in metafunc.fixturenames:
        metafunc.parametrize("gpu_case", [pytest.param(c, id=c.node_id) for c in _cases(metafunc.config)])
    if "gpu_kill" in metafunc.fixturenames:
        from gpu.checks import kind_kills  # registered by catalogue.load() above

        kinds = {str(c.path): c.kind for c in metafunc.config.stash[SESSION_KEY].checkpoints}
        kills = []
        for case in _cases(metafunc.config):
            claimed = [item.name for item in ablation.all_ablations() if case.check in item.kills]
            claimed += [name for name in kind_kills(kinds.get(case.checkpoint or "", ""), case.check)
                        if name not in claimed]
            kills += [pytest.param(item, id=item.node_id) for item in
                      (dataclasses.replace(case, ablation=name) for name in claimed)]
        metafunc.parametrize("gpu_kill", kills)


@pytest.mark.gpu
def test_gpu_check(gpu_case, parity_session, request):
    ctx = parity_session.context(gpu_device(request.config), gpu_case.dtype, gpu_case.checkpoint)
    verdict = parity_session.check(gpu_case.check, ctx, label=gpu_case.report_label)
    assert verdict.passed, verdict.describe()


@pytest.mark.gpu
def test_gpu_ablation_kills_check(gpu_kill, parity_session, request):
    """The gpu checks have teeth on real weights too: each claimed ablation must make them fail."""
    name, check_id, label = gpu_kill.ablation, gpu_kill.check, gpu_kill.report_label
    ctx = parity_session.context(gpu_device(request.config), gpu_kill.dtype, gpu_kill.checkpoint)
    baseline = parity_session.check(check_id, ctx, label=label)
    assert baseline.passed, f"{label} must pass without {name} first:\n{baseline.describe()}"
    if check_id.startswith("decode.") and gpu_world_size(ctx) < 2:
        pytest.skip("one rank: the sharded decode has no second rank here, so only the stock gate is checked")
    result = parity_session.kill(name, check_id, ctx, label=label)
    assert result.killed, f"{name} ({ablation.get(name).why}) did not kill {label}: {result.how}\n{result.detail}"
