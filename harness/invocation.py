"""The command as typed, whichever form a path option takes.

pytest chooses its rootdir and reads its configuration before any plugin's options exist, so the value of
``--capture-dir DIR`` (the space form) reads to it as a test path: with DIR outside this project, the rootdir
lands outside it, this project's pyproject.toml is never read (no markers, no testpaths, no addopts) and pytest
collects whatever lies under the working directory. The ``=`` form never meets this. When it happens, the same
command is run again with this project's configuration named (``-c``), so both forms work.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

__all__ = ["PATH_OPTIONS", "PROJECT_CONFIG", "RERUN_MARK", "rerun_with_project_config", "space_form_paths"]

PATH_OPTIONS = ("--parity-report", "--checkpoint", "--capture-dir", "--device-map")
PROJECT_CONFIG = Path(__file__).resolve().parents[1] / "pyproject.toml"
RERUN_MARK = "FASTPATH_PARITY_RERUN"  # set in the command run again: it never runs a third time
_CHOOSES_CONFIG = ("-c", "--config-file", "--rootdir", "--inifile")


def space_form_paths(args: Sequence[str]) -> list[str]:
    """The values of this suite's path options given as the next argument (``--capture-dir DIR``)."""
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in PATH_OPTIONS]


def rerun_with_project_config(config: pytest.Config) -> None:
    """Run the command again with ``-c`` naming this project's pyproject.toml when a path option's space form made
    pytest read its configuration from elsewhere (or from nowhere); otherwise return."""
    args = [str(arg) for arg in config.invocation_params.args]
    if config.inipath == PROJECT_CONFIG or os.environ.get(RERUN_MARK) or not space_form_paths(args):
        return
    if any(arg.split("=", 1)[0] in _CHOOSES_CONFIG or (arg.startswith("-c") and arg != "-c") for arg in args):
        return  # the caller chose the configuration itself
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[RERUN_MARK] = "1"
    command = [sys.executable, "-m", "pytest", "-c", str(PROJECT_CONFIG), *args]
    print(f"fastpath-parity: pytest read {space_form_paths(args)} as test paths and configured itself from "
          f"{config.inipath or 'no file'}; running the same command with -c {PROJECT_CONFIG}", file=sys.stderr,
          flush=True)
    os.execv(sys.executable, command)
