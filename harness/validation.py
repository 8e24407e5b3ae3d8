"""Every file and option a run reads, checked before collection: a malformed one is a usage error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.inputs import checkpoints
from harness.judging import space
from harness.options import parse_dtypes
from harness.process import launch
from harness.reports import report

__all__ = ["LOADABLE", "validate_inputs", "writes_reports"]

LOADABLE = ("diffusers", "transformers", "remote_code")  # checkpoint sources load_model builds a model from


def validate_inputs(config: pytest.Config) -> list[checkpoints.Checkpoint]:
    """Every file and option the run reads, checked now: any malformed one is a usage error naming it.

    Checkpoints are detected (their config.json may hold anything), remote code is refused without
    --trust-remote-code, capture files are read, and each --parity-report path is opened for writing,
    all before collection, so nothing fails after the checks ran.
    """
    trusted = bool(config.getoption("trust_remote_code"))
    checkpoints.trust_remote_code(trusted)
    detected = []
    for path in config.getoption("checkpoint") or []:
        try:
            found = checkpoints.detect(path)
            checkpoints.require_trust(found, trusted)
        except checkpoints.CheckpointError as err:
            raise pytest.UsageError(f"--checkpoint: {err}") from None
        if found.feeds == "attention":
            _validate_captures(f"--checkpoint {path}", found.path)
        detected.append(found)
    parse_dtypes(config.getoption("dtype"))
    capture = config.getoption("capture_dir")
    if capture is not None:
        if not Path(capture).is_dir():
            from harness.attention.capture import not_a_file

            raise pytest.UsageError(f"--capture-dir {not_a_file(Path(capture), 'a directory of capture files')}")
        _validate_captures(f"--capture-dir {capture}", Path(capture))
    if writes_reports():
        for path in config.getoption("parity_report") or []:
            try:
                report.prepare(path)
            except ValueError as err:
                raise pytest.UsageError(str(err)) from None
    try:
        launch.set_fault_bound(config.getoption("fault_bound"))
        launch.fault_bound()  # the environment's value is checked too
        space.space_mode()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    return detected


def _validate_captures(option: str, directory: Path) -> None:
    from harness.attention import capture

    try:
        capture.validate_directory(directory)
    except ValueError as err:
        raise pytest.UsageError(f"{option}: {err}") from None


def writes_reports() -> bool:
    """Under torchrun only rank 0 writes the report, so only rank 0 checks where it goes."""
    try:
        launched = launch.launched()
    except ValueError:
        return True  # the launch environment's own error is reported by _configure_placement
    return launched is None or launched.rank == 0
