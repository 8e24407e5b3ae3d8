"""The gpu tier's hooks: a HunyuanImage-3 checkpoint dry-run on a CPU gets, by itself, the patches its code needs;
``--dry-run-kind KIND`` runs gpu/test_dry_run.py's dry run over one tiny checkpoint kind instead of every kind.

Both generations' remote code assumes a CUDA stack (a torchvision that imports, ``torch.cuda.set_device``, NVTX,
a CUDA ``torch.empty``); ``fixtures.upstream_cpu`` patches those from outside. A user dry-running the gpu tier on
their own checkpoint (``--device cpu``, or ``auto`` on a host without CUDA) should not need to know that module, so
it is installed here whenever such a run names a checkpoint whose config.json points at HunyuanImage-3's code.
The config is read as data; nothing from the checkpoint runs here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures import upstream_cpu
from harness.ar.backends import remote_code_generation


def hunyuan_checkpoints(paths: list[str] | None) -> list[str]:
    """The checkpoints among ``paths`` whose config.json's auto_map names a HunyuanImage-3 generation (an unreadable
    config names nothing here: the plugin refuses it with a usage error of its own)."""
    found = []
    for path in paths or ():
        try:
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(config, dict) and remote_code_generation(config) is not None:
            found.append(path)
    return found


def dry_run_on_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--dry-run-kind", action="append", default=None, metavar="KIND",
                     help="gpu/test_dry_run.py's gpu tier dry run over this tiny checkpoint kind only (repeatable; "
                          "default: every kind the stack can load, about 15 minutes on 2 cores)")


def dry_run_kinds(config: pytest.Config) -> tuple[str, ...] | None:
    """The kinds ``--dry-run-kind`` names (None: every kind), each one the dry run can write, or a usage error."""
    from fixtures import checkpoints as tiny_checkpoints

    asked = config.getoption("dry_run_kind", None)
    if not asked:
        return None
    known = tiny_checkpoints.writers()
    unknown = sorted(set(asked) - set(known))
    if unknown:
        raise pytest.UsageError(f"--dry-run-kind {', '.join(unknown)}: no tiny checkpoint kind of that name; the dry "
                                f"run writes {', '.join(sorted(known))}")
    return tuple(dict.fromkeys(asked))


def pytest_sessionstart(session: pytest.Session) -> None:
    dry_run_kinds(session.config)  # a misspelt kind is a usage error before collection


def pytest_configure(config: pytest.Config) -> None:
    if dry_run_on_cpu(config.getoption("device")) and hunyuan_checkpoints(config.getoption("checkpoint")):
        upstream_cpu.install()
