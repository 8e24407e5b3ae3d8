"""The fastpath-parity pytest plugin: options, markers, the session that runs checks, the report.

Loaded by the repo's conftest.py and exposed as a ``pytest11`` entry point, so an installed
harness brings it to any pytest run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import ablation as ablation_mod
from harness import checkpoints, checks, launch, report
from harness import device_map as device_maps
from harness.ablation import KillResult
from harness.checks import CheckContext
from harness.compare import Verdict

MARKERS = {
    "cpu": "CPU tier: fake kernels and tiny random-init models, every parity check and ablation",
    "gpu": "GPU tier: real checkpoints (needs CUDA and --checkpoint)",
    "bench": "pytest-benchmark measurements of a fast path against its stock path",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SESSION_KEY = pytest.StashKey["ParitySession"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastpath-parity")
    group.addoption("--parity-report", action="append", default=None, metavar="PATH",
                    help="write the parity report to PATH (.md or .json); repeatable")
    group.addoption("--checkpoint", action="append", default=None, metavar="PATH",
                    help="a real checkpoint directory for the gpu tier; repeatable")
    group.addoption("--dtype", default="fp32,bf16", metavar="LIST",
                    help="gpu-tier dtypes: fp32, bf16, or both (comma-separated, or 'both'); default fp32,bf16")
    group.addoption("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="gpu-tier device: auto (cuda when available), cpu (dry run of the gpu tier), cuda")
    group.addoption("--capture-dir", default=None, metavar="DIR",
                    help="attention captures (call0_rank0.npz style) to run the attention checks on "
                         "(pytest's own --capture is taken)")
    _add_placement_options(group)


def _add_placement_options(group: Any) -> None:
    group.addoption("--device-map", default=None, metavar="MAP",
                    help="place gpu-tier models with accelerate across the visible GPUs: balanced, auto, sequential, "
                         "or a JSON max-memory split like '{\"0\": \"70GiB\", \"1\": \"70GiB\"}'; default: one "
                         "device where the weights fit, else balanced")


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = ["fp32", "bf16"] if text.strip() == "both" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        raise pytest.UsageError(f"--dtype {text!r}: expected fp32, bf16, fp16, 'both' or a comma list; "
                                f"unknown {unknown}")
    return [DTYPES[n] for n in names]


class ParitySession:
    """Runs checks and ablations for a pytest session and keeps what they said for the report."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.verdicts: dict[str, Verdict] = {}
        self.kills: list[KillResult] = []
        self._contexts: dict[tuple[Any, ...], CheckContext] = {}
        self._pools: dict[str, Any] = {}
        self.capture_dir: str | None = config.getoption("capture_dir")
        self.checkpoints: list[checkpoints.Checkpoint] = []

    def context(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                checkpoint: str | None = None) -> CheckContext:
        device = torch.device(device)
        key = (device.type, dtype, checkpoint)
        if key not in self._contexts:
            from harness.dist import WorldPool

            pool = self._pools.setdefault(device.type, WorldPool(device=device))
            self._contexts[key] = CheckContext(device=device, dtype=dtype, checkpoint=checkpoint,
                                               capture_dir=self.capture_dir, worlds=pool)
        return self._contexts[key]

    def check(self, check_id: str, ctx: CheckContext | None = None, label: str | None = None) -> Verdict:
        """Run a check once per label (cached: the kill matrix reuses the baseline)."""
        key = label or check_id
        if key not in self.verdicts:
            verdict = checks.run_check(check_id, ctx or self.context())
            self.verdicts[key] = dataclasses.replace(verdict, check_id=key) if label else verdict
        return self.verdicts[key]

    def kill(self, ablation_name: str, check_id: str, ctx: CheckContext | None = None,
             label: str | None = None) -> KillResult:
        """Run ``check_id`` under the ablation; ``label`` names the check in the report (gpu: checkpoint, dtype)."""
        result = ablation_mod.run_under(ablation_mod.get(ablation_name), check_id, ctx or self.context())
        if label:
            result = dataclasses.replace(result, check=label)
        self.kills.append(result)
        return result

    def report(self) -> dict[str, Any]:
        order = {c.id: i for i, c in enumerate(checks.all_checks())}
        verdicts = sorted(self.verdicts.values(), key=lambda v: (order.get(v.check_id, len(order)), v.check_id))
        return report.build(verdicts, self.kills)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    detected = []
    for path in config.getoption("checkpoint") or []:
        try:
            detected.append(checkpoints.detect(path))
        except checkpoints.CheckpointError as err:
            raise pytest.UsageError(f"--checkpoint: {err}") from None
    parse_dtypes(config.getoption("dtype"))
    capture = config.getoption("capture_dir")
    if capture is not None and not Path(capture).is_dir():
        raise pytest.UsageError(f"--capture-dir {capture}: no such directory")
    for path in config.getoption("parity_report") or []:
        if Path(path).suffix not in (".md", ".json"):
            raise pytest.UsageError(f"--parity-report {path}: the file must end in .md or .json")
    session = ParitySession(config)
    session.checkpoints = detected
    config.stash[SESSION_KEY] = session
    _configure_placement(config)


def _configure_placement(config: pytest.Config) -> None:
    """Where ranks and models go: PARITY_START_METHOD, --device-map, and the torchrun group when launched."""
    from harness.dist import resolve_start_method

    device = gpu_device(config)
    try:
        resolve_start_method(device.type)
        text = config.getoption("device_map")
        device_maps.configure(device_maps.parse(text) if text is not None else None, device.type)
        if launch.launched() is not None:
            launch.join(device.type)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def reporting_rank() -> bool:
    """Under torchrun only rank 0 prints the table and writes the report; every rank does otherwise."""
    joined = launch.joined()
    return joined is None or joined.rank == 0


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.close()
    _release_placement()


def _release_placement() -> None:
    """Leave the torchrun group and forget --device-map (an in-process pytester run must not inherit either)."""
    launch.leave()
    device_maps.configure(None, "")


def gpu_device(config: pytest.Config) -> torch.device:
    choice = config.getoption("device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def gpu_skip_reason(config: pytest.Config) -> str | None:
    """Why the gpu tier cannot run here, or None when it can."""
    choice = config.getoption("device")
    if choice != "cpu" and not torch.cuda.is_available():
        return ("gpu tier needs CUDA: torch.cuda.is_available() is False on this machine "
                "(pass --device cpu for a dry run of the gpu tier on the CPU)")
    if not config.getoption("checkpoint"):
        return "gpu tier needs real weights: pass --checkpoint=PATH (repeatable) to run it"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_skip_reason(config)
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def parity_session(request: pytest.FixtureRequest) -> ParitySession:
    """The run's parity session: runs checks and ablations and records them for the report."""
    return request.config.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def parity_ctx(parity_session: ParitySession) -> CheckContext:
    """The CPU tier's context: fp32 on the CPU, gloo worlds shared across checks."""
    return parity_session.context()


@pytest.fixture(scope="session")
def gpu_dtypes(request: pytest.FixtureRequest) -> list[torch.dtype]:
    return parse_dtypes(request.config.getoption("dtype"))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None or not (session.verdicts or session.kills) or not reporting_rank():
        return
    data = session.report()
    terminalreporter.section("fastpath-parity report")
    terminalreporter.write_line(report.render_terminal(data))
    for path in config.getoption("parity_report") or []:
        written = report.write(data, path)
        terminalreporter.write_line(f"parity report written to {os.fspath(written)}")
    _summarise_placement(terminalreporter)


def _summarise_placement(terminalreporter: Any) -> None:
    """Say how this run's ranks started and where device-mapped models went (the dry run's proof)."""
    joined = launch.joined()
    if joined is not None:
        terminalreporter.write_line(f"ranks: torchrun group of {joined.world_size} (this is rank {joined.rank})")
    for checkpoint, text, placed in device_maps.placements():
        devices = sorted(set(placed.values()))
        terminalreporter.write_line(f"device map {text}: {checkpoint} on {', '.join(devices)} "
                                    f"({len(placed)} placement entries)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under torchrun every rank reports each phase alike: a failure on any rank fails it on every rank.

    Ranks agree phase by phase over the launcher's side group, so no rank runs a call that another
    rank's failed or skipped setup did not reach (which would leave the ranks out of step).
    """
    rep = yield
    joined = launch.joined()
    if joined is None:
        return rep
    detail = rep.longreprtext.strip().splitlines()[-1][:400] if (rep.failed or rep.skipped) and rep.longrepr else ""
    statuses = launch.agree(rep.outcome, detail)
    failed = [(rank, text) for rank, (status, text, _) in enumerate(statuses) if status == "failed"]
    skipped = [(rank, text) for rank, (status, text, _) in enumerate(statuses) if status == "skipped"]
    if failed and not rep.failed:
        rep.outcome = "failed"
        rep.longrepr = (f"{item.nodeid} {call.when} failed on ranks {[r for r, _ in failed]} of {joined.world_size} "
                        f"(passed here, on rank {joined.rank}):\n"
                        + "\n".join(f"rank {r}: {text}" for r, text in failed))
    elif skipped and rep.passed and call.when == "setup":
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        f"skipped on ranks {[r for r, _ in skipped]}: {skipped[0][1]}")
    return rep
