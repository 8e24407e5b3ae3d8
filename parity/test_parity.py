"""One pytest item per registered CPU-tier parity check, generated from the registry."""

import pytest

from harness.judging import catalogue, checks
from harness.judging.items import check_params

catalogue.load()


@pytest.mark.cpu
@pytest.mark.parametrize("parity", check_params(c.id for c in checks.all_checks("cpu")))
def test_parity_check(parity, parity_session, parity_ctx):
    verdict = parity_session.check(parity.check, parity_ctx)
    assert verdict.passed, verdict.describe()
