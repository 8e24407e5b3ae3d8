"""One pytest item per registered CPU-tier parity check, generated from the registry."""

import pytest

from harness import catalogue, checks

catalogue.load()


@pytest.mark.cpu
@pytest.mark.parametrize("check_id", [c.id for c in checks.all_checks("cpu")])
def test_parity_check(check_id, parity_session, parity_ctx):
    verdict = parity_session.check(check_id, parity_ctx)
    assert verdict.passed, verdict.describe()
