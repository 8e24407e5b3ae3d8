"""judge_decode on hand-made rank answers: the verdict's metrics and facts for a sharded, a stock and a user's run.

No world: the RankDecode values are what a 2-rank run of 12 latent frames (2 clips of 9 tiles) reports.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from fixtures import decode_models
from harness.decode import judge, oracle
from harness.decode import plan as plan_mod
from harness.judging.compare import sha256

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def _answers(sharded: bool, *, impl_calls: int | None = None, calls: int = 1) -> list[judge.RankDecode]:
    """``calls`` `_decode` calls per video (a sliced batch): every count scales with it."""
    work = plan_mod.plan_work(decode_models.tiny_vae(), (1, 4, 12, 8, 8), 2)  # clips split: 9 tiles per clip
    stock = torch.arange(39.0).reshape(1, 1, 39, 1, 1)
    digest = sha256(stock)
    decoder = (9 if sharded else 18) * calls  # each rank owns one clip of 9 tiles, or decodes both
    seen = {"all_gather": 4 * calls} if sharded else {}
    return [judge.RankDecode(rank, 2, stock.clone(), digest, decoder, (1 if sharded else 2) * calls,
                             pieces=work.num_units, dst=0, group=0, collectives=dict(seen), work=work, calls=calls,
                             stock=stock if rank == 0 else None, stock_sha256=digest, impl_calls=impl_calls)
            for rank in range(2)]


def test_sharded_and_stock_runs_report_their_transport_share_and_facts():
    sharded = judge.judge_decode(_answers(True), sharded=True)
    assert sharded.passed, sharded.describe()
    picked = {k: sharded.metrics[k] for k in ("world", "receivers", "transport", "ranks_matching_stock_sha",
                                              "decoder_calls_per_rank", "split", "clips", "busiest_share")}
    assert picked == {"world": 2, "receivers": 2, "transport": "all_gather", "ranks_matching_stock_sha": "2/2",
                      "decoder_calls_per_rank": "9, 9", "split": "clips", "clips": 2, "busiest_share": 0.5}
    stock = judge.judge_decode(_answers(False), sharded=False)
    assert stock.passed, stock.describe()
    assert (stock.metrics["transport"], stock.metrics["busiest_share"]) == ("stock", 1.0)
    assert stock.violated_facts == [] and len(stock.notes) == 4  # bytes, hashes, placement, no move
    # a sharded verdict on a run that decoded everything everywhere fails on the ownership fact
    everywhere = judge.judge_decode(_answers(False), sharded=True)
    assert "each piece decoded exactly once across the world (round-robin ownership)" in everywhere.violated_facts
    sliced = judge.judge_decode(_answers(True, calls=2), sharded=True)
    assert sliced.passed and sliced.metrics["expected_decoder_calls_per_rank"] == "18, 18"
    # 3 ranks split the 18 tiles 6 / 6 / 6 (no clip calls): the share is rounded to 4 digits
    three = [dataclasses.replace(a, rank=r, world_size=3, decoder_calls=6, clip_calls=0,
                                 work=plan_mod.plan_work(decode_models.tiny_vae(), (1, 4, 12, 8, 8), 3))
             for r, a in enumerate([*_answers(True), _answers(True)[1]])]
    tiled = judge.judge_decode(three, sharded=True)
    assert tiled.passed, tiled.describe()
    assert (tiled.metrics["split"], tiled.metrics["busiest_share"]) == ("tiles", 0.3333)
    assert judge.judge_decode(_answers(False, calls=2), sharded=False).passed
    # the right total on the wrong ranks: rank 0 decoded both clips and rank 1 sat idle, without collectives
    first, second = _answers(True)
    lopsided = [dataclasses.replace(first, decoder_calls=18), dataclasses.replace(second, decoder_calls=0,
                                                                                  collectives={})]
    verdict = judge.judge_decode(lopsided, sharded=True)
    assert "each piece decoded exactly once across the world (round-robin ownership)" in verdict.violated_facts
    assert verdict.metrics["collectives_per_rank"] == "{'all_gather': 4}; none"


def test_wrong_shapes_hashes_and_a_user_run_without_collectives_fail():
    answers = _answers(True)
    short = dataclasses.replace(answers[1], output=answers[1].output[:, :, :38])  # its reported hash is stale
    verdict = judge.judge_decode([answers[0], short], sharded=True)
    assert not verdict.passed and verdict.margin == float("inf") and verdict.violated_facts == []  # shapes alone
    assert verdict.message.startswith("decoded video shapes [(1, 1, 38, 1, 1), (1, 1, 39, 1, 1)] differ from the "
                                      "stock (1, 1, 39, 1, 1)")
    rehashed = dataclasses.replace(short, sha256=sha256(short.output))
    verdict = judge.judge_decode([answers[0], rehashed], sharded=True)
    assert verdict.violated_facts == ["every receiving rank's SHA-256 equals the stock output's"]
    user = _answers(True, impl_calls=1, calls=2)  # a user's implementation under test: rank 1 ran no collective
    user[1] = dataclasses.replace(user[1], collectives={})
    verdict = judge.judge_decode(user, sharded=True)
    assert verdict.violated_facts == ["every rank communicated (a collective ran on every rank)"]
    assert verdict.metrics["collectives_per_rank"] == "{'all_gather': 8}; none"
    assert (verdict.metrics["pieces_per_rank"], verdict.metrics["pieces_total"]) == ("18, 18", 36)


def test_an_output_off_the_stock_device_or_dtype_or_moved_to_the_cpu_fails_its_fact_by_rank():
    """Equal bytes are not enough: the video must stay where the stock call leaves it, in its dtype, and be no CPU
    copy the call made (on the CPU tier the device alone cannot show that)."""
    placed = [dataclasses.replace(a, device="cuda:0", home="cuda:0", stock_device="cuda:0") for a in _answers(True)]
    assert judge.judge_decode(placed, sharded=True).passed
    moved_off = [placed[0], dataclasses.replace(placed[1], device="cpu")]
    verdict = judge.judge_decode(moved_off, sharded=True)
    assert verdict.violated_facts == [judge.PLACED]
    assert (verdict.metrics["placement"], verdict.metrics["stock_placement"]) == (
        "rank 1: cpu float32 (its latents on cuda:0)", "cuda:0 float32")
    first, second = _answers(True)
    cast = dataclasses.replace(second, output=second.output.double())  # a dtype the stock call does not return
    verdict = judge.judge_decode([first, dataclasses.replace(cast, sha256=sha256(cast.output))], sharded=True)
    assert judge.PLACED in verdict.violated_facts and verdict.metrics["placement"] == "rank 1: ? float64 (its " \
                                                                                      "latents on ?)"
    copied = [first, dataclasses.replace(second, moved_by="Tensor.cpu()")]
    verdict = judge.judge_decode(copied, sharded=True)
    assert verdict.violated_facts == [judge.NOT_MOVED] and verdict.metrics["moved_to_cpu"] == "rank 1: Tensor.cpu()"
    gathered = [dataclasses.replace(a, transport="gather") for a in _answers(True)]  # rank 1 receives nothing
    gathered[1] = dataclasses.replace(gathered[1], output=None, sha256=None, moved_by="Tensor.cpu()")
    assert judge.NOT_MOVED not in judge.judge_decode(gathered, sharded=True).violated_facts


def test_the_plan_oracle_passes_the_plan_and_names_same_shaped_wrong_windows(monkeypatch):
    z = decode_models.latents(decode_models.LatentSpec(9, height=2, width=2))  # 2 clips, one cross-fade
    cases = [(decode_models.tiny_vae(), z)]
    verdict = oracle.judge_plan_against_library(cases)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics == {"cases": 1, "window_mismatches": "none", "tile_mismatches": "none",
                               "source_mismatches": "none"}
    # windows and tiles of the right shape but read backwards in time must not pass
    window, tile = plan_mod.window_latents, plan_mod.tile_latents
    monkeypatch.setattr(plan_mod, "window_latents", lambda padded, plan, c: window(padded, plan, c).flip(2))
    flipped = oracle.judge_plan_against_library(cases)
    assert flipped.metrics["window_mismatches"] == ["t9 (2, 2) tiling=on: plan 2 clips, library 2"]
    monkeypatch.setattr(plan_mod, "window_latents", window)
    monkeypatch.setattr(plan_mod, "tile_latents", lambda w, tiles, t: tile(w, tiles, t).flip(2))
    flipped = oracle.judge_plan_against_library(cases)
    assert flipped.metrics["tile_mismatches"] == ["t9 (2, 2) tiling=on: plan 2 tiles, library 2"]


def test_the_plan_oracle_records_what_the_library_passed_not_a_view_of_the_caller_s_latents():
    """7 latent frames + token_drop 3 fill whole chunks: no padding, so the library slices the caller's z itself."""
    vae = decode_models.tiny_vae()
    z = decode_models.latents(decode_models.LatentSpec(7, height=1, width=1))
    seen = oracle.observe_stock_decode(vae, z)
    plan = plan_mod.plan_clips(vae, 7)
    planned = [plan_mod.window_latents(z, plan, c).clone() for c in range(plan.num_clips)]  # one tile per clip
    z.zero_()  # the caller reuses its latents buffer
    assert [len(tiles) for tiles in seen["tiles"]] == [1] * plan.num_clips
    assert all(torch.equal(w, p) for w, p in zip(seen["windows"], planned, strict=True))
    assert all(torch.equal(t, p) for (t,), p in zip(seen["tiles"], planned, strict=True))


def test_the_plan_oracle_reads_a_frame_that_is_no_single_clip_s_constant_as_unnamed():
    """Clip c decodes to the constant 4**c: a frame of 4**c is clip c's, one strictly between 4**c and 4**(c+1) the
    cross-fade of c and c + 1, and a frame that is not one constant (or is below 4**0) is (-1,), a source no plan
    names; every frame gets its entry, in order."""
    frames = [[1.0, 1.0], [4.0, 4.0], [2.5, 2.5], [1.0, 4.0], [0.0, 0.0], [16.0, 16.0]]
    video = torch.tensor(frames, dtype=torch.float64).reshape(1, 1, len(frames), 1, 2)  # (B, C, F, H, W)
    assert oracle._observed_sources(video) == [(0,), (1,), (0, 1), (-1,), (-1,), (2,)]
    pixels = torch.tensor([1.0, 2.5, 4.0], dtype=torch.float64).reshape(1, 1, 3, 1, 1)  # one-pixel frames are read too
    assert oracle._observed_sources(pixels) == [(0,), (0, 1), (1,)]


def test_a_stock_run_that_communicated_names_the_collectives_of_each_rank():
    """The stock call runs no collective: a rank that ran one fails the stock fact, and the verdict shows what each
    rank ran ("none" for a rank that ran nothing)."""
    first, second = _answers(False)
    verdict = judge.judge_decode([dataclasses.replace(first, collectives={"all_gather": 1}), second], sharded=False)
    assert verdict.violated_facts == ["the stock call was taken: every rank decoded every piece, no collective ran"]
    assert verdict.metrics["collectives_per_rank"] == "{'all_gather': 1}; none"


def _outcome(rank: int, raised: str = "RuntimeError: stop", *, fired: int = 0, kept: bool | None = None,
             seconds: float = 0.1) -> judge.FaultOutcome:
    return judge.FaultOutcome(rank, raised, seconds, fired, kept)


def test_a_fault_that_other_ranks_never_hear_of_fails_even_without_a_hang():
    """Rank 1 raises alone while the others return: nobody is stuck, but the group did not fail together."""
    alone = [_outcome(0, ""), _outcome(1, fired=1, kept=True), _outcome(2, "")]
    verdict = judge.judge_fault(3, 1, 20.0, alone, keeps_cause="fault rank")
    assert not verdict.passed
    assert verdict.metrics["outcome"] == "1/3 ranks raise; ranks [0, 2] returned"
    together = [_outcome(0), _outcome(1, fired=1, kept=True), _outcome(2)]
    assert judge.judge_fault(3, 1, 20.0, together, keeps_cause="fault rank").passed


def test_faults_are_judged_by_behaviour_not_by_wording():
    """Any exception type and message will do; what counts is that every rank raised in time, the fault struck,
    the injected cause survives where it must, and the group works afterwards."""
    plain = [_outcome(0, "ValueError: whatever the wording"), _outcome(1, "KeyError: 3", fired=1, kept=True)]
    assert judge.judge_fault(2, 1, 20.0, plain, keeps_cause="fault rank").passed
    lost = [plain[0], _outcome(1, "RuntimeError: failed", fired=1, kept=False)]
    verdict = judge.judge_fault(2, 1, 20.0, lost, keeps_cause="fault rank")
    assert verdict.violated_facts == ["the injected exception survives in the __cause__/__context__ chain of what "
                                      "rank 1 raised"]
    at_bound = [plain[0], _outcome(1, "KeyError: 3", fired=1, kept=True, seconds=20.0)]
    assert judge.judge_fault(2, 1, 20.0, at_bound, keeps_cause="fault rank").passed  # within 20 s includes 20 s
    wordy = [plain[0], _outcome(1, "KeyError: " + "k" * 400, fired=1, kept=True)]
    lines = judge.judge_fault(2, 1, 20.0, wordy, keeps_cause="fault rank").metrics["rank_outcomes"]
    assert [len(line) for line in lines] == [len("rank 0: ValueError: whatever the wording"), 240]
    slow = [plain[0], _outcome(1, "KeyError: 3", fired=1, kept=True, seconds=25.0)]
    verdict = judge.judge_fault(2, 1, 20.0, slow, keeps_cause="fault rank")
    assert verdict.violated_facts == ["every rank raises within 20 s; no rank hangs or returns"]
    never = [plain[0], _outcome(1, "KeyError: 3")]  # the implementation never reached the faulty decoder
    verdict = judge.judge_fault(2, 1, 20.0, never)
    assert verdict.violated_facts == ["the fault struck on rank(s) [1]"]
    broken = judge.judge_fault(2, 1, 20.0, plain, keeps_cause="fault rank", group_error="hung")
    assert broken.violated_facts == [judge.GROUP_WORKS] and broken.metrics["follow_up"] == "hung"


def test_a_hung_rank_fails_with_the_world_statuses():
    from harness.process.dist import RankOutcome

    statuses = [RankOutcome(0, "ok"), RankOutcome(1, "hung", "no result within 20 s")]
    verdict = judge.judge_fault(2, 1, 20.0, None, statuses, group_error="the world was torn down")
    assert not verdict.passed and verdict.metrics["outcome"] == "hung on ranks [1]"
    assert set(verdict.violated_facts) == {"every rank raises within 20 s; no rank hangs or returns",
                                           judge.GROUP_WORKS}
    long = [statuses[0], RankOutcome(1, "raised", "RuntimeError: " + "x" * 400)]  # a traceback-sized error
    lines = judge.judge_fault(2, 1, 20.0, None, long).metrics["rank_outcomes"]
    assert lines == ["rank 0: ok", long[1].line()[:240]] and len(lines[1]) == 240
    nobody = judge.judge_fault(2, 1, 20.0, [])  # no rank's outcome: no raise time to claim
    assert not nobody.passed and nobody.metrics["slowest_raise_s"] == 0.0


def test_the_slowest_raise_is_reported_to_the_millisecond():
    """A fault's raise times are wall-clock readings: the report gives the slowest in whole milliseconds, not the
    clock's noise digits."""
    outcomes = [_outcome(0, seconds=0.0123456), _outcome(1, fired=1, kept=True, seconds=1.2345678)]
    assert judge.judge_fault(2, 1, 20.0, outcomes).metrics["slowest_raise_s"] == 1.235


def test_a_bad_frame_names_the_rank_that_decoded_its_clip():
    """The decoder inputs each rank fingerprinted, matched against the stock decode's, name a bad frame's maker."""
    answers = _answers(True)
    answers[0] = dataclasses.replace(answers[0], stock_decoded=tuple(f"p{i}" for i in range(18)),
                                     decoded=tuple(f"p{i}" for i in range(9)))
    answers[1] = dataclasses.replace(answers[1], decoded=tuple(f"p{i}" for i in range(9, 18)))
    bad = answers[1].output.clone()
    bad[:, :, 30] += 1.0
    answers[1] = dataclasses.replace(answers[1], output=bad, sha256=sha256(bad))
    verdict = judge.judge_decode(answers, sharded=True)
    assert verdict.metrics["clip_producers"] == "clip 0: rank 0; clip 1: rank 1"
    assert "frame 30 (clip 1 on rank 1)" in verdict.message, verdict.message
    assert judge.frame_labels(answers[0].work.clips, 39, {0: [0]})[18] == (
        "18 (clip 0 on rank 0/1 (its planned input decoded on no rank) cross-fade)")


def test_without_fingerprints_a_bad_frame_is_named_by_its_clip_alone():
    """A run that fingerprinted no decoder inputs says nothing of who made a clip: no producers, and no label that
    claims a clip's input was decoded on no rank."""
    answers = _answers(True)
    bad = answers[1].output.clone()
    bad[:, :, 30] += 1.0
    answers[1] = dataclasses.replace(answers[1], output=bad, sha256=sha256(bad))
    assert judge.producers(answers) is None
    verdict = judge.judge_decode(answers, sharded=True)
    assert "frame 30 (clip 1)" in verdict.message, verdict.message
    assert "clip_producers" not in verdict.metrics


def test_a_sliced_sharded_encode_counts_each_rank_s_clips_once_per_call():
    """Two `_encode` calls (a sliced batch of two videos), two clips over two ranks: each rank encodes its clip
    once per call; a count that does not scale with the calls is a clip encoded twice or never."""
    encode = [dataclasses.replace(a, work=None, pieces=2, clip_calls=2) for a in _answers(True, calls=2)]
    fact = "each clip encoded exactly once across the world"
    assert fact not in judge.judge_decode(encode, sharded=True).violated_facts
    once = [dataclasses.replace(a, clip_calls=1) for a in encode]
    assert fact in judge.judge_decode(once, sharded=True).violated_facts


@pytest.mark.parametrize("calls", [1, 2, 3])
def test_each_decode_call_runs_the_whole_fail_closed_sequence_again(calls):
    """Probe, gather status, payload, assemble status, once per `_decode` call: the payload collective is the one
    the transport names."""
    assert judge.expected_collectives("all_gather", calls) == {"all_gather": 4 * calls}
    assert judge.expected_collectives("gather", calls) == {"all_gather": 3 * calls, "gather": calls}


def test_a_fault_world_that_did_not_answer_fails_and_says_whether_the_group_still_works():
    ranks = [types.SimpleNamespace(rank=0, status="hung", line=lambda: "rank 0: hung"),
             types.SimpleNamespace(rank=1, status="raised", line=lambda: "rank 1: raised")]
    answered = judge.judge_fault(2, 1, 2.0, None, ranks)
    assert not answered.passed and answered.metrics["outcome"] == "hung on ranks [0]; raised on ranks [1]"
    assert answered.metrics["follow_up"] == "the group answered" and judge.GROUP_WORKS not in answered.violated_facts
    broken = judge.judge_fault(2, 1, 2.0, None, ranks, group_error="the all-gather timed out")
    assert judge.GROUP_WORKS in broken.violated_facts and broken.metrics["follow_up"] == "the all-gather timed out"
