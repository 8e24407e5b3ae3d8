"""Spawned ranks start with nothing: they must rebuild the catalogues to re-apply a task's ablation.

CUDA worlds spawn (a CUDA context cannot be forked), so a rank on a GPU node imports the suite from
scratch. One spawned 2-rank gloo world here runs a decode check and the same check under an applied
decode ablation: the rank loads the whole catalogue (harness.judging.catalogue:load, named by the task) and
the kill is seen in its declared mode.
"""

import os

import pytest

from harness.inputs import compat
from harness.judging import ablation, catalogue, checks
from harness.judging.checks import CheckContext
from harness.process.dist import START_METHODS, World, WorldPool, resolve_start_method

# the launchers (spawned ranks, torchrun, the gpu tier's dry run) are marked `launch`: scripts/test-all runs
# them; the rest of this file is CPU-tier machinery

CHECK = "decode.t12.w2.bitexact"
ABLATION = "decode.crossfade_skipped"
PARENT_MARK: int | None = None  # set in the parent at run time: a spawned rank re-imports this module without it


def rank_state() -> tuple[int | None, bool, int]:
    """(this module's parent mark, whether the catalogue is loaded, pid) as a rank sees them."""
    return PARENT_MARK, catalogue.loaded(), os.getpid()


@pytest.mark.cpu
def test_start_method_defaults_and_choices(monkeypatch):
    monkeypatch.delenv("PARITY_START_METHOD", raising=False)
    assert resolve_start_method("cuda") == "spawn"
    assert resolve_start_method("cpu") == "fork"
    for method in START_METHODS:
        monkeypatch.setenv("PARITY_START_METHOD", method)
        assert resolve_start_method("cpu") == method
        assert World(2).start_method == method
    monkeypatch.setenv("PARITY_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match=r"PARITY_START_METHOD='forkserver': expected one of spawn, fork"):
        World(2)
    monkeypatch.setenv("PARITY_START_METHOD", "fork")
    with pytest.raises(ValueError, match="CUDA worlds cannot fork"):
        resolve_start_method("cuda")
    with pytest.raises(ValueError, match=r"start_method='threads'"):
        World(2, start_method="threads")


@pytest.mark.launch
@pytest.mark.skipif(compat.path_unavailable("decode") is not None, reason=str(compat.path_unavailable("decode")))
def test_spawned_ranks_rebuild_the_catalogue_and_see_the_decode_kill():
    global PARENT_MARK
    catalogue.load()
    PARENT_MARK = os.getpid()
    pool = WorldPool(start_method="spawn")
    try:
        world = pool.get(2)
        assert world.start_method == "spawn"
        print(f"spawned 2-rank gloo world started in {world.startup_s:.2f} s")
        before = world.run(rank_state)
        assert [mark for mark, _, _ in before] == [None, None], "the ranks were forked, not spawned"
        assert [loaded for _, loaded, _ in before] == [False, False]
        ctx = CheckContext(worlds=pool)
        baseline = checks.run_check(CHECK, ctx)
        assert baseline.passed, baseline.describe()
        result = ablation.run_under(ablation.get(ABLATION), CHECK, ctx)
        assert result.killed and result.mode == result.declared == "tolerance", (result.how, result.detail)
        after = world.run(rank_state)
        assert pool.get(2) is world, "the world was torn down by the ablated task"
        assert [loaded for _, loaded, _ in after] == [True, True], "the ranks did not load the catalogue"
        assert [pid for *_, pid in after] == [pid for *_, pid in before]
    finally:
        PARENT_MARK = None
        pool.close()
