"""Path options typed both ways, as the docs print them: ``--capture-dir DIR`` and ``--capture-dir=DIR`` must give
the same run. pytest picks its rootdir before this suite's options exist, so the space form's DIR reads to it as a
test path (harness.invocation); each case runs pytest in a fresh interpreter (``launch``, run by scripts/test-all)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import invocation
from harness.attention import capture as capture_io

pytestmark = pytest.mark.launch

REPO = Path(__file__).resolve().parents[1]


def _collect(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != invocation.RERUN_MARK}
    return subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def _items(done: subprocess.CompletedProcess) -> list[str]:
    return sorted(line for line in done.stdout.splitlines() if "::" in line)


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory) -> Path:
    """A capture directory outside the repository, as scripts/capture-attention writes one."""
    from fixtures import attention_captures

    directory = tmp_path_factory.mktemp("captures")
    for phase, call in capture_io.SEED_CALLS.items():
        capture_io.save_capture(attention_captures.seed_capture(phase), directory / capture_io.capture_name(call))
    return directory


def test_every_path_option_is_known_to_the_rerun():
    """Every option of this suite that takes a path is in the list the rerun looks for."""
    from harness import options

    class Group:
        def __init__(self):
            self.found = []

        def addoption(self, name, *more, metavar=None, **kwargs):
            self.found.append((name, metavar))

    class Parser:
        def __init__(self):
            self.group = Group()

        def getgroup(self, *args, **kwargs):
            return self.group

        def addini(self, *args, **kwargs):
            pass

    parser = Parser()
    options.add_options(parser)
    takes_a_path = {name for name, metavar in parser.group.found if metavar in ("PATH", "DIR", "MAP")}
    assert takes_a_path and takes_a_path <= set(invocation.PATH_OPTIONS), takes_a_path


def test_capture_dir_in_the_space_form_runs_as_the_equals_form_does(capture_dir):
    """The form scripts/capture-attention prints: the same items, this project's configuration, no collection
    error; the run says why it started again."""
    spaced = _collect("-m", "cpu", "-k", "capture", "--capture-dir", str(capture_dir))
    joined = _collect("-m", "cpu", "-k", "capture", f"--capture-dir={capture_dir}")
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    assert spaced.returncode == 0, spaced.stdout[-3000:] + spaced.stderr[-3000:]
    assert _items(spaced) == _items(joined) and _items(joined), (_items(spaced)[:5], _items(joined)[:5])
    assert "running the same command with -c" in spaced.stderr, spaced.stderr


def test_a_report_path_that_exists_outside_the_repository_in_the_space_form(tmp_path):
    """A report written again to the same place (the file exists, so pytest would read it as a test path)."""
    report = tmp_path / "parity.json"
    report.write_text("{}")
    spaced = _collect("-m", "cpu", "-k", "tokens", "--parity-report", str(report))
    joined = _collect("-m", "cpu", "-k", "tokens", f"--parity-report={report}")
    assert spaced.returncode == joined.returncode == 0, spaced.stdout[-3000:] + spaced.stderr[-3000:]
    assert _items(spaced) == _items(joined) and _items(joined)


def test_a_checkpoint_directory_in_the_space_form_meets_the_same_usage_error(tmp_path):
    """A directory that holds no checkpoint: the same usage error, naming it, in both forms."""
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    spaced = _collect("-m", "gpu", "--checkpoint", str(empty))
    joined = _collect("-m", "gpu", f"--checkpoint={empty}")
    assert joined.returncode == pytest.ExitCode.USAGE_ERROR, joined.stdout[-2000:] + joined.stderr[-2000:]
    assert spaced.returncode == joined.returncode, spaced.stdout[-2000:] + spaced.stderr[-2000:]
    assert str(empty) in spaced.stderr and str(empty) in joined.stderr
