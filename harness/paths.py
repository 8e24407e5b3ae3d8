"""The four fast paths the suite judges, written once.

A check id, an ablation name and a report label all start with their path (``decode.t37.w8.bitexact``,
``decode.fade_labels_off_by_one``); ``path_of`` is the one place that reads it back from such a name.
"""

from __future__ import annotations

import enum

__all__ = ["PATHS", "ParityPath", "path_of"]


class ParityPath(enum.StrEnum):
    """A fast path and its stock twin: what ``--impl PATH=...`` names and what a checkpoint feeds."""

    REPLAY = "replay"
    AR = "ar"
    DECODE = "decode"
    ATTENTION = "attention"


PATHS: tuple[str, ...] = tuple(path.value for path in ParityPath)


def path_of(name: str) -> str:
    """The path a dotted name belongs to: its first segment (the machinery's own tests use paths like ``demo``)."""
    return name.partition(".")[0]
