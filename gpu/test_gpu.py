"""The gpu tier: one item per (registered gpu check, checkpoint of the kind it needs, dtype).

Without CUDA (and without --device cpu) or without --checkpoint every item is skipped with a reason
(harness.plugin); with them, each check runs on real weights and lands in the parity report.
"""

from pathlib import Path

import pytest
import torch

from harness import checks
from harness.plugin import SESSION_KEY, gpu_device, parse_dtypes
from parity import catalogue

catalogue.load()

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def pytest_generate_tests(metafunc):
    if "gpu_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
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
    metafunc.parametrize("gpu_case", cases)


@pytest.mark.gpu
def test_gpu_check(gpu_case, parity_session, request):
    check_id, checkpoint, dtype = gpu_case
    ctx = parity_session.context(gpu_device(request.config), dtype, checkpoint)
    label = f"{check_id}[{Path(checkpoint).name}-{DTYPE_NAMES[dtype]}]"
    verdict = parity_session.check(check_id, ctx, label=label)
    assert verdict.passed, verdict.describe()
