"""The decode space's stated geometry is the tiny VAE's own (the clips, the tile overlaps and the split each point's id
and its ablation claims are computed from), and the overlap axis is what tells a stitch that crops a seam by
another seam's overlap."""

from __future__ import annotations

import itertools

import pytest

from fixtures import decode_models, decode_space
from harness.decode import plan as plan_mod
from harness.judging import ablation, catalogue, space
from parity import decode_checks, decode_space_checks

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def test_every_point_decodes_the_geometry_its_values_name():
    vae = decode_models.tiny_vae()
    assert decode_space.POINTS, "no decode space point drawn"
    for point in decode_space.POINTS:
        case, ranks = decode_space_checks.case_at(point), decode_space.ranks(point)
        shape = (case.batch, decode_models.TINY_VAE.latent_channels, case.frames, case.height, case.width)
        work = plan_mod.plan_work(vae, shape, ranks)
        assert work.clips.pad_tokens == 0 and work.clips.num_clips == decode_space.clips(point)
        assert (work.clips.num_clips < ranks) == (point["clips"] == "fewer") and work.clips.num_clips != ranks
        assert work.tiles is not None and work.tiles.num_tiles == decode_space.TILES
        assert (len(set(work.tiles.x_overlaps)) > 1) == (point["overlaps"] == "unequal"), point
        assert work.split == decode_space.split(point)
        assert len(case.groups) == (2 if point["groups"] == "two" else 0) and ranks >= 2
        assert sorted(r for group in case.groups for r in group) == (list(range(case.world)) if case.groups else [])
        assert case.dtype == point["dtype"]
        assert space.point(decode_space.check_id(point)) == {"vae": "minimax_h3", "transport": "all_gather",
                                                             "slicing": "off", **point}
    assert [plan_mod.plan_tiles(vae, decode_space.HEIGHT, w).x_overlaps for w in decode_space.WIDTHS.values()] == [
        (4, 4), (4, 2)]


def test_the_points_cover_every_pair_the_constraint_allows():
    axes = decode_space.AXES
    every = [dict(zip(axes, row, strict=True)) for row in itertools.product(*axes.values())]
    wanted = {(a, p[a], b, p[b]) for p in every if decode_space.allowed(p) for a, b in itertools.combinations(axes, 2)}
    points = decode_space.POINTS
    assert wanted <= {(a, p[a], b, p[b]) for p in points for a, b in itertools.combinations(axes, 2)}
    assert all(decode_space.allowed(p) for p in points)


def test_only_an_unequal_grid_shows_a_stitch_cropping_by_the_previous_seam(parity_ctx):
    """The ablation claims the unequal points alone because the same bug passes an equal grid: [4, 4] px crops
    the same by either seam's overlap."""
    catalogue.load()
    bug = ablation.get("decode.stitch_crops_previous_overlap")
    point = {"overlaps": "equal", "world": "w2", "clips": "more", "groups": "one", "dtype": "float32"}
    unequal = {**point, "overlaps": "unequal"}
    assert decode_space.split(point) == "tiles"  # the tiles are served to the stitch
    with bug.apply():
        survived = decode_checks.decode_check(decode_space_checks.case_at(point), parity_ctx)
        killed = decode_checks.decode_check(decode_space_checks.case_at(unequal), parity_ctx)
    assert survived.passed, survived.describe()
    assert not killed.passed and killed.message.startswith(
        "decoded video shapes [(1, 3, 56, 8, 16)] differ from the stock (1, 3, 56, 8, 18)")  # 2 px short
