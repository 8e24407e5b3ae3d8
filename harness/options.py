"""The run's command-line options and markers, and what the gpu-tier options mean (dtypes, device)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.plugins import conformance
from harness.process import launch

__all__ = ["DTYPES", "MARKERS", "add_options", "gpu_device", "gpu_skip_reason", "parse_dtypes"]

MARKERS = {
    "cpu": "CPU tier: fake kernels and tiny random-init models, every parity check and ablation",
    "gpu": "GPU tier: real checkpoints (needs CUDA and --checkpoint)",
    "bench": "pytest-benchmark measurements of a fast path against its stock path",
    "launch": "the launchers on the CPU: spawned ranks, torchrun, the gpu tier's dry run (scripts/test-all runs them)",
    "browser": "the HTML report rendered in headless Chromium (scripts/test-all runs it; skipped without it)",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastpath-parity")
    group.addoption("--parity-report", action="append", default=None, metavar="PATH",
                    help="write the parity report to PATH (.md, .json or .html); repeatable")
    group.addoption("--checkpoint", action="append", default=None, metavar="PATH",
                    help="a real checkpoint directory for the gpu tier; repeatable")
    group.addoption("--dtype", default="fp32,bf16", metavar="LIST",
                    help="gpu-tier dtypes: fp32, bf16, or both (comma-separated, or 'both'); default fp32,bf16")
    group.addoption("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="gpu-tier device: auto (cuda when available), cpu (dry run of the gpu tier), cuda")
    group.addoption("--trust-remote-code", action="store_true", default=False,
                    help="allow loading checkpoints whose config.json has an auto_map: their own Python files run "
                         "(HunyuanImage-3 needs it). Off by default, as in transformers; the report records what ran")
    group.addoption("--capture-dir", default=None, metavar="DIR",
                    help="attention captures (call0_rank0.npz style) to run the attention checks on "
                         "(pytest's own --capture is taken)")
    group.addoption("--impl", action="append", default=None, metavar="PATH[.SUBJECT]=MODULE:CALLABLE",
                    help="run PATH's checks against your own implementation (conformance mode); repeatable. "
                         "PATH.SUBJECT gives one for a single replay family, ar model or decode VAE "
                         "(--impl replay.sd3=my_trainer.stages:sd3_replay); checks of a subject no given "
                         "implementation declares are not judged, with the reason. The callable's 'declares' "
                         "attribute (harness.plugins.declarations) says what it drives and supports. Signatures: "
                         + "; ".join(f"{p}: {sig}" for p, sig in conformance.SIGNATURES.items()))
    group.addoption("--parity-list", nargs="?", const="*", default=None, metavar="PATTERN",
                    help="list the checks (id, module:qualname, tier, policy, killers) whose id matches the "
                         "fnmatch PATTERN (default: all), then exit without running tests")
    _add_placement_options(group)


def _add_placement_options(group: Any) -> None:
    group.addoption("--device-map", default=None, metavar="MAP",
                    help="place gpu-tier models with accelerate across the visible GPUs: balanced, auto, sequential, "
                         "or a JSON max-memory split like '{\"0\": \"70GiB\", \"1\": \"70GiB\"}'; default: one "
                         "device where the weights fit, else balanced")
    group.addoption("--fault-bound", default=None, metavar="SECONDS",
                    help="under torchrun, every rank raises within SECONDS of any rank raising, stopping or dying "
                         f"(default ${launch.FAULT_BOUND_ENV} or {launch.DEFAULT_FAULT_BOUND_S:g})")


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = ["fp32", "bf16"] if text.strip() == "both" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        raise pytest.UsageError(f"--dtype {text!r}: expected fp32, bf16, fp16, 'both' or a comma list; "
                                f"unknown {unknown}")
    return [DTYPES[n] for n in names]


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
