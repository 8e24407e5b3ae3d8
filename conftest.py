"""Repo-root conftest: loads the parity plugin and the hypothesis profiles."""

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from fixtures.bench_timing import bench_rounds
from harness.inputs import host

pytest_plugins = ["harness.plugin", "pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """A fixed intra-op thread count: measured noise floors depend on the GEMM reduction split, so the same
    command gives the same report on any machine (world ranks run one thread each). Set before collection builds
    any model; a malformed PARITY_THREADS (or PARITY_BENCH_ROUNDS) is a usage error naming it. Without checkpoints
    (the CPU tier) freed tensors stay in malloc's heap for the next check instead of going back to the kernel."""
    try:
        torch.set_num_threads(host.threads_from_environment())
        bench_rounds(1)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    if not config.getoption("checkpoint", default=None):
        host.keep_freed_memory()


# "ci" (the default) is derandomised, so the same command draws the same examples and writes the same report
# on every run and host; "dev" explores (HYPOTHESIS_PROFILE=dev), for a session hunting new counterexamples.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "mutation" (what scripts/mutation-score runs) draws the ci examples and stops at a failure: shrinking the
# counterexample a mutant caused took up to 30 s per mutant, and only whether a test fails is read there.
settings.register_profile(
    "mutation",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")
