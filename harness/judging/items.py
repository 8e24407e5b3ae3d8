"""The typed parity item a generated pytest item runs: which check, under which ablation, on what.

Test generators parametrize one argument with ``ParityItem`` values (``check_params``, ``kill_params``); the
plugin finds the value by its type when the item is collected and keeps it in ``item.stash``, so conformance
selection and the report read what an item runs instead of guessing it from argument names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["PARITY_ITEM_KEY", "ParityItem", "check_params", "item_check", "keep_parity_item", "kill_params",
           "parity_item"]


@dataclass(frozen=True)
class ParityItem:
    """One check, optionally under one ablation; ``label`` names it in the report (gpu: checkpoint and dtype).

    ``checkpoint`` and ``dtype`` are the gpu tier's: a real checkpoint directory and the dtype to load it in.
    """

    check: str
    ablation: str = ""
    label: str = ""
    checkpoint: str | None = None
    dtype: Any = None

    @property
    def report_label(self) -> str:
        return self.label or self.check

    @property
    def node_id(self) -> str:
        """The pytest id: the report label, behind its ablation for a kill item."""
        return f"{self.ablation}->{self.report_label}" if self.ablation else self.report_label


def check_params(check_ids: Iterable[str]) -> list[Any]:
    """One pytest parameter per check id, named by it."""
    return [pytest.param(ParityItem(check_id), id=check_id) for check_id in check_ids]


def kill_params(pairs: Iterable[tuple[str, str]]) -> list[Any]:
    """One pytest parameter per (ablation, claimed check), named ``ablation->check``."""
    items = [ParityItem(check_id, ablation=name) for name, check_id in pairs]
    return [pytest.param(item, id=item.node_id) for item in items]


PARITY_ITEM_KEY = pytest.StashKey[ParityItem]()  # what a generated item runs


def keep_parity_item(item: pytest.Item) -> None:
    """Keep the ``ParityItem`` a generated item was parametrized with (found by its type) in the item's stash."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = [value for value in params.values() if isinstance(value, ParityItem)]
    if len(found) > 1:
        raise pytest.UsageError(f"{item.nodeid}: parametrized with {len(found)} parity items; one item runs one")
    if found:
        item.stash[PARITY_ITEM_KEY] = found[0]


def parity_item(item: pytest.Item) -> ParityItem | None:
    """What a generated item runs, or None for any other test."""
    return item.stash.get(PARITY_ITEM_KEY, None)


def item_check(item: pytest.Item) -> tuple[str | None, bool]:
    """(the check id a generated item runs, whether it runs it under an ablation); (None, False) otherwise."""
    found = parity_item(item)
    return (found.check, bool(found.ablation)) if found is not None else (None, False)
