"""The CPU checks of one path, run without ablations: the base line that ablation-sweep tests stand on."""

from __future__ import annotations

from typing import Any

import pytest

from harness.judging import checks
from harness.plugins import conformance


def unablated_check_ids(path: str, session: Any, ctx: Any) -> list[str]:
    """Every CPU check of ``path`` passes with nothing ablated (which also fills the caches outside any ablation);
    the ids come back. Under ``--impl`` for ``path`` the sweep would judge the suite's own seams, not the user's
    callable, so the caller is skipped."""
    spec = conformance.active(path)
    if spec is not None:
        pytest.skip(f"--impl {path}={spec}: these tests apply the suite's own ablations to the suite's seams")
    ids = [c.id for c in checks.all_checks("cpu") if c.path == path]
    failed = [i for i in ids if not session.check(i, ctx).passed]
    assert not failed, f"{path} checks failing without any ablation: {failed}"
    return ids
