"""Where the rows of a failing batched forward came from, in the path's own words.

A tiling bug does not change what the model is handed, only where: every row of a wrongly nested batch is still
some (CFG branch, target step, sample) row the stock loop handed the model at that step. So the rows of the batched
forward are traced back, by their bytes, to the serial forwards' rows; when every row is found, the order they came
in names the bug ("CFG tiling nested step-major outside the branches") instead of a log-prob difference at some
row and step. Rows that match no stock row (a field transformed, truncated or lost) are counted and left to the
numbers.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence

import torch

__all__ = ["ORDER", "row_layout"]

ORDER = ("branch", "step", "sample")  # the batched forward's nesting: branch-major outside, step-major inside

# what a component's sequence over the forward's rows means when it follows another nesting than ``ORDER``
NAMED = {
    ("branch", ("step", "branch", "sample")):
        "the CFG branches alternate every B rows ([{b0}_s0, {b1}_s0, {b0}_s1, ...]): the conditions were tiled "
        "step-major outside the branches, where one forward needs each branch's S steps together ([{b0}_s0, "
        "{b0}_s1, ..., {b1}_s0, ...]), so the model's midpoint split mixes the CFG branches",
    ("step", ("branch", "sample", "step")):
        "each sample's S steps are adjacent (repeat_interleave) where the stack is step-major: the B samples of "
        "target[0], then those of target[1], ...",
}


NOUNS = {"branch": "CFG branches", "step": "steps", "sample": "samples"}
SHOWN = 8  # rows a generic description shows


def _named(component: str, order: tuple[str, ...] | None, got: Sequence[int], want: Sequence[int],
           labels: Sequence[str]) -> str:
    """What ``component`` does wrong across the rows: a named nesting bug, else its first rows beside the stack's."""
    text = NAMED.get((component, order)) if order is not None else None
    if text is not None:
        return text.format(b0=labels[0], b1=labels[-1])
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), 0)
    window = slice(first, first + SHOWN)  # from the first row that differs: rows that agree say nothing
    where = f"from row {first}, " if first else ""
    return (f"the {NOUNS[component]} run, {where}{', '.join(labels[v] for v in got[window])}, ... where the stack "
            f"holds {', '.join(labels[v] for v in want[window])}, ...")


def _signature(tensors: Mapping[str, torch.Tensor], row: int) -> str:
    """A row's identity: the bytes of every row-aligned input, by argument name (whatever order they came in)."""
    digest = hashlib.sha1()
    for name in sorted(tensors):
        piece = tensors[name][row].detach().contiguous().cpu()
        digest.update(str((name, piece.dtype, tuple(piece.shape))).encode())
        digest.update(piece.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _rows(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    count = int(next(iter(tensors.values())).shape[0]) if tensors else 0
    return [_signature(tensors, r) for r in range(count)]


def _nested(order: Sequence[str], sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every (branch, step, sample) in the order a batch nested ``order[0]``-major outside would hold them."""
    return [dict(zip(order, place, strict=True)) for place in itertools.product(*(range(sizes[n]) for n in order))]


def row_layout(serial: Sequence[Mapping[str, torch.Tensor]], batched: Mapping[str, torch.Tensor],
               target: Sequence[int],
               branches: Sequence[str], batch: int) -> str | None:
    """How the batched forward's rows are laid out, when that is what is wrong; None when they are in the expected
    order, when some row matches no stock row, or when the inputs cannot be traced (another field set).

    ``serial[s]`` are the row-aligned inputs of the stock forward at ``target[s]`` (its rows ``[branch][sample]``),
    ``batched`` those of the one batched forward; ``branches`` names the branches in the forward's order.
    """
    steps = len(target)
    if len(serial) != steps or not batched or any(set(inputs) != set(batched) for inputs in serial):
        return None
    origin: dict[str, tuple[int, int, int]] = {}
    for s, inputs in enumerate(serial):
        for r, sig in enumerate(_rows(inputs)):
            origin.setdefault(sig, (r // batch, s, r % batch))
    found = [origin.get(sig) for sig in _rows(batched)]
    if any(place is None for place in found) or len(found) != len(branches) * steps * batch:
        return None
    sizes = {"branch": len(branches), "step": steps, "sample": batch}
    got = [dict(zip(ORDER, place, strict=True)) for place in found if place is not None]
    expected = _nested(ORDER, sizes)
    if got == expected:
        return None
    labels = {"branch": list(branches), "step": [f"step {t}" for t in target],
              "sample": [f"sample {k}" for k in range(batch)]}
    named = []
    for component in ORDER:
        sequence = [place[component] for place in got]
        want = [place[component] for place in expected]
        if sequence == want:
            continue
        other = next((order for order in itertools.permutations(ORDER)
                      if sequence == [place[component] for place in _nested(order, sizes)]), None)
        named.append(_named(component, other, sequence, want, labels[component]))
    wrong = [(r, place) for r, (place, want) in enumerate(zip(got, expected, strict=True)) if place != want][:3]
    shown = "; ".join(f"row {r} holds {branches[p['branch']]} step {target[p['step']]} sample {p['sample']}"
                      for r, p in wrong)
    return f"the batched forward's rows are stock rows in the wrong places: {'; '.join(named)} ({shown})"
