"""Usage errors only a fresh interpreter shows: the repository's conftest reads its environment before collection,
so these run pytest in a subprocess (seconds each: ``launch``, run by scripts/test-all)."""

import os

import pytest

pytestmark = pytest.mark.launch


def test_a_malformed_thread_count_is_a_usage_error_naming_the_variable():
    """The repository's conftest pins torch's threads from PARITY_THREADS before collection: a value that is not a
    positive integer stops the run as a usage error naming it, not an ImportError from inside the conftest."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                           "tests/test_progress.py"], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PARITY_THREADS": "0"})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "PARITY_THREADS='0': expected a positive integer" in done.stderr, done.stderr
    assert "ImportError" not in done.stdout + done.stderr
