"""The kill matrix, generated from the registries: every claimed (ablation, check) pair must
pass without the ablation and fail with it; every check must be claimed by some ablation."""

import pytest

from harness.judging import ablation, catalogue, checks
from harness.judging.items import kill_params

catalogue.load()

# CPU-tier pairs run here; claims on gpu-tier checks run in gpu/test_gpu.py on real (or dry-run) checkpoints
PAIRS = [(a.name, check_id) for a in ablation.all_ablations() for check_id in a.kills
         if checks.get(check_id).tier == "cpu"]


@pytest.mark.cpu
@pytest.mark.parametrize("parity", kill_params(PAIRS))
def test_ablation_kills_check(parity, parity_session, parity_ctx):
    ablation_name, check_id = parity.ablation, parity.check
    baseline = parity_session.check(check_id, parity_ctx)
    assert baseline.passed, f"{check_id} must pass without {ablation_name} first:\n{baseline.describe()}"
    result = parity_session.kill(ablation_name, check_id, parity_ctx)
    assert result.killed, (f"ablation {ablation_name} ({ablation.get(ablation_name).why}) did not kill "
                           f"{check_id} in its declared mode {result.declared!r}: it was {result.mode!r} "
                           f"({result.how})\n{result.detail}")


@pytest.mark.cpu
def test_every_check_is_killed_by_some_ablation():
    claimed = {c for a in ablation.all_ablations() for c in a.kills}
    unclaimed = [c.id for c in checks.all_checks("cpu") if c.id not in claimed]
    assert not unclaimed, f"checks no ablation claims to kill (a check without teeth): {unclaimed}"


@pytest.mark.cpu
def test_every_gpu_check_is_killed_by_some_ablation():
    claimed = {c for a in ablation.all_ablations() for c in a.kills}
    unclaimed = [c.id for c in checks.all_checks("gpu") if c.id not in claimed]
    assert not unclaimed, f"gpu-tier checks no ablation claims to kill: {unclaimed}"


@pytest.mark.cpu
def test_every_ablation_claims_a_cpu_check():
    cpu_ids = {c.id for c in checks.all_checks("cpu")}
    idle = [a.name for a in ablation.all_ablations() if not set(a.kills) & cpu_ids]
    assert not idle, f"ablations that claim no CPU-tier check: {idle}"
