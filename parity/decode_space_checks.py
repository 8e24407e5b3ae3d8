"""Decode checks over the input space (``fixtures.decode_space``): one check per drawn point, its id naming it.

Each point runs the catalogue's decode check (``parity.decode_checks.decode_check``) in the world of its size the
catalogue already keeps: every receiving rank's video bitwise the stock decode's, the spies of the path, the output
on the stock device and dtype and not handed back as a CPU copy; under ``--impl decode=...`` the implementation under
test is what runs, and a declaration that leaves a point's input class out puts that check under the guard contract.
"""

from __future__ import annotations

import functools

from fixtures import decode_space
from harness.judging import checks, space
from harness.judging.compare import exact
from parity.decode_checks import DecodeCase, decode_check

__all__ = ["case_at"]


def case_at(point: dict[str, str]) -> DecodeCase:
    """The decode case of one point: its world, latent geometry, subgroups and dtype."""
    return DecodeCase(decode_space.frames(point), decode_space.world(point), dtype=point["dtype"],
                      groups=decode_space.partition(point), height=decode_space.HEIGHT,
                      width=decode_space.WIDTHS[point["overlaps"]])


for _point in decode_space.POINTS:
    _id = decode_space.check_id(_point)
    checks.register(_id, policy=exact(), doc=f"the tiny MiniMax-H3 VAE at {space.describe(_point)}")(
        functools.partial(decode_check, case_at(_point)))
    space.at(_id, vae="minimax_h3", transport="all_gather", slicing="off", **_point)
