"""Fail closed beyond the catalogue's W = 8 / rank 3 cases: other ranks, sizes, splits and transports, a rank's
second piece, and faults after the probe (gather buffers, the payload collective, post-loop); and non-finite
inputs, which the sharded path must decode exactly as the stock one does."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fixtures import decode_models, decode_tasks
from harness.decode import exchange, serve, sharded
from harness.judging import compare
from harness.process import dist as dist_mod
from harness.process.dist import WorldTaskError
from parity import decode_checks

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]

CASES = [
    # (world, faulty rank, kind, latent frames, split, transport)
    (4, 0, "decoder_raises", 37, "auto", "all_gather"),  # tiles: 63 over 4
    (4, 3, "ragged_clip", 37, "clips", "all_gather"),
    (2, 1, "second_clip_raises", 37, "clips", "all_gather"),  # rank 1 owns clips 1, 3, 5
    (2, 0, "second_clip_ragged", 37, "tiles", "all_gather"),
    (3, 2, "ragged_clip", 13, "clips", "all_gather"),  # padded tail: rank 2 owns the last clip
    (8, 1, "decoder_raises", 12, "clips", "all_gather"),  # six idle ranks must raise too
    (4, 1, "gather_raises", 22, "auto", "gather"),
    (2, 0, "post_loop_raises", 22, "clips", "all_gather"),
    (3, 1, "post_loop_raises", 13, "auto", "gather"),  # only the destination (rank 1) runs the post-loop
]


@pytest.mark.parametrize(("world", "rank", "kind", "frames", "split", "transport"), CASES,
                         ids=[f"w{w}-rank{r}-{k}-t{t}-{s}-{tr}" for w, r, k, t, s, tr in CASES])
def test_every_rank_raises_together_and_the_group_survives(world, rank, kind, frames, split, transport, parity_ctx):
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(frames), split=split, transport=transport,
                                     dst=rank if transport == "gather" else 0)
    verdict = decode_checks.run_fault(parity_ctx.world(world), job, kind, rank,
                                      timeout_s=30.0)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["outcome"] == f"{world}/{world} ranks raise"


def test_an_unknown_fault_kind_is_rejected(parity_ctx):
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(12))
    with pytest.raises(WorldTaskError, match="fault kind must be one of"):
        parity_ctx.world(1).run(decode_tasks.fault_task, job, 0, "flaky")


def test_ranks_handed_different_latent_videos_all_raise_instead_of_a_ragged_gather(parity_ctx):
    world = parity_ctx.world(2)
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))  # 4 clips; rank 1 gets 27 frames: 5 clips
    with pytest.raises(WorldTaskError) as info:
        world.run(decode_tasks.uneven_latents_task, job, 1, 5, timeout_s=30.0)
    outcomes = info.value.outcomes
    assert [o.status for o in outcomes] == ["raised", "raised"], str(info.value)
    assert all("rank 0 planned 22 latent frames; rank 1 planned 27 latent frames" in o.error for o in outcomes)
    assert world.alive
    assert world.alive


# ------------------------------------------------------------------ NaN and Inf: sharded == stock, bit for bit

SPECIALS = {  # float32 bit patterns written into one input element
    "nan": 0x7FC00000,
    "nan_payload": 0x7FC0BEEF,  # a quiet NaN carrying a payload
    "negative_nan": 0xFFC00001 - 2**32,
    "inf": 0x7F800000,
    "negative_inf": 0xFF800000 - 2**32,
}


def _with_special(x: torch.Tensor, bits: int, frame: int) -> torch.Tensor:
    """``x`` with one element of ``frame`` replaced by the float32 whose bit pattern is ``bits``."""
    x = x.clone()
    x[0, 0, frame, 1, 2] = torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]
    return x


def _outcome(call) -> tuple[str, str]:
    """("ok", SHA-256 of the result's bytes: NaN payloads included) or ("raised", the exception type)."""
    try:
        result = call()
    except Exception as err:  # noqa: BLE001 - both raising is an accepted outcome, compared below
        return "raised", type(err).__name__
    return "ok", compare.sha256(result)


def _decoded(job: decode_tasks.TinyDecodeJob, vae, z: torch.Tensor) -> dict[str, object]:
    return {"sharded": lambda: sharded.sharded_decode(vae, z, dist.group.WORLD, split=job.split),
            "stock": lambda: sharded.stock_decode(vae, z)}


def _encoded(job: decode_tasks.EncodeJob, vae, x: torch.Tensor) -> dict[str, object]:
    return {"sharded": lambda: sharded.sharded_encode(vae, x, dist.group.WORLD).parameters,
            "stock": lambda: sharded.stock_encode(vae, x).parameters}


def special_task(job, specials: dict[str, int], frame: int) -> dict[str, dict[str, tuple[str, str]]]:
    """Per special value written into the job's input: the sharded call on every rank, the stock one on rank 0."""
    vae = job.build_vae()
    encode = isinstance(job, decode_tasks.EncodeJob)
    clean = job.build_video(torch.device("cpu")) if encode else job.build_latents(torch.device("cpu"))
    seen = {}
    for name, bits in specials.items():
        calls = (_encoded if encode else _decoded)(job, vae, _with_special(clean, bits, frame))
        with torch.no_grad():
            seen[name] = {which: _outcome(call) for which, call in calls.items()
                          if which == "sharded" or dist.get_rank() == 0}
    return seen


def _same_as_stock(results: list[dict[str, dict[str, tuple[str, str]]]]) -> None:
    for name in results[0]:
        stock = results[0][name]["stock"]
        for rank, got in enumerate(results):
            assert got[name]["sharded"] == stock, f"{name}, rank {rank}: sharded {got[name]['sharded']} != {stock}"


@pytest.mark.parametrize(("split", "world"), [("clips", 2), ("tiles", 3)])
def test_sharded_decode_of_nan_and_inf_is_stock_bit_for_bit(split, world, parity_ctx):
    """Latent frame 6 lies in clips 0 and 1 (their cross-fade): both paths give the same bits, NaN payloads too."""
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(12), split=split)
    results = parity_ctx.world(world).run(special_task, job, SPECIALS, 6, timeout_s=60.0)
    _same_as_stock(results)
    assert {results[0][name]["stock"][0] for name in SPECIALS} == {"ok"}, "stock takes non-finite latents"


def test_sharded_encode_of_nan_and_inf_is_stock_bit_for_bit(parity_ctx):
    job = decode_tasks.EncodeJob(frames=30)
    specials = {name: SPECIALS[name] for name in ("nan_payload", "negative_inf")}
    _same_as_stock(parity_ctx.world(2).run(special_task, job, specials, 20, timeout_s=60.0))


def test_the_piece_server_compares_bit_patterns():
    nan = torch.tensor([float("nan"), 1.0])
    assert serve.same_bits(nan, nan.clone()), "a NaN input is the planned one when its bits are"
    assert not serve.same_bits(torch.tensor([0.0]), torch.tensor([-0.0])), "-0.0 is not the planned 0.0"
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not serve.same_bits(nan[:1], other_nan), "another NaN payload is another input"
    assert serve.same_bits(nan, nan.double()) is False and serve.same_bits(nan, nan[:1]) is False  # a bool
    half = torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)  # two-byte elements: compared as int16
    assert serve.same_bits(half, half.clone()) and not serve.same_bits(half, torch.tensor([-0.0, float("nan")],
                                                                                          dtype=torch.bfloat16))
    flags = torch.tensor([True, False])  # one-byte elements: compared as uint8
    assert serve.same_bits(flags, flags.clone()) and not serve.same_bits(flags, ~flags)
    wide = torch.tensor([1 + 2j, -3j], dtype=torch.complex128)  # 16-byte elements: two float64 parts each
    assert serve.same_bits(wide, wide.clone()) and not serve.same_bits(wide, wide.conj().resolve_conj())
    assert serve.same_bits(wide.conj(), wide.conj().resolve_conj())  # a lazily conjugated input is its values
    server = serve.PieceServer(lambda i: nan, [torch.zeros(1)], "decoder (one tile)")
    assert server(nan.clone()) is server.pieces[0]
    with pytest.raises(sharded.ShardedDecodeError, match="not the planned one"):
        serve.PieceServer(lambda i: nan, [torch.zeros(1)], "decoder (one tile)")(torch.tensor([-0.0, 1.0]))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                                   torch.complex128], ids=str)
def test_inputs_of_every_item_size_are_compared_bit_for_bit(dtype: torch.dtype):
    """1-, 2-, 4- and 8-byte floats, and complex ones part by part: a NaN input is the planned one when its bits
    are, and -0.0 is never the planned 0.0 (torch.equal would say the opposite of both)."""
    zero, negative = torch.tensor([0.0, -0.0]).to(dtype).split(1)
    nan = torch.full((2,), float("nan"), dtype=dtype)
    assert serve.same_bits(nan, nan.clone()) and serve.same_bits(zero, zero.clone())
    assert not serve.same_bits(zero, negative)


def test_an_input_of_another_dtype_is_not_the_planned_one_even_with_the_same_bits():
    """Zeros are zero bits in float32 and int32 alike: the dtype, not the bit pattern, tells them apart."""
    assert not serve.same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.int32))
    assert not serve.same_bits(torch.zeros(4), torch.zeros(2, 2))  # nor is another shape of the same zeros


def raise_after_gather_task(job: decode_tasks.TinyDecodeJob, fault_rank: int) -> str:
    """Sharded decode where ``fault_rank`` raises right after its payload collective returned."""
    vae = job.build_vae()
    z = job.build_latents(torch.device("cpu"))
    original = exchange.collect

    def collect_then_raise(*args, **kwargs):
        original(*args, **kwargs)
        raise decode_tasks.InjectedFault(f"after-gather:rank{fault_rank}",
                                         f"injected fault right after the payload gather on rank {fault_rank}")

    patched = collect_then_raise if dist.get_rank() == fault_rank else original
    exchange.collect = patched
    try:
        with torch.no_grad():
            return compare.sha256(sharded.sharded_decode(vae, z, dist.group.WORLD))
    finally:
        exchange.collect = original


@pytest.mark.parametrize(("world", "rank"), [(2, 1), (4, 0)])
def test_a_raise_right_after_the_payload_gather_reaches_every_rank_at_once(world, rank, parity_ctx):
    """The payload collective sits inside the protocol: every rank raises at the assemble status, no grace wait."""
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))
    group = parity_ctx.world(world)
    began = time.monotonic()
    with pytest.raises(WorldTaskError) as info:
        group.run(raise_after_gather_task, job, rank, timeout_s=30.0)
    took = time.monotonic() - began
    outcomes = info.value.outcomes
    follow_up = group.run(decode_tasks.decode_task, job, timeout_s=30.0)
    hashes = {r.sha256 for r in follow_up if r.output is not None} | {follow_up[0].stock_sha256}
    assert [o.status for o in outcomes] == ["raised"] * world, str(info.value)
    assert all("failed at the assemble step" in o.error for o in outcomes), str(info.value)
    assert "right after the payload gather" in next(o.error for o in outcomes if o.rank == rank)
    assert len(hashes) == 1, "the group decodes bit-exactly again afterwards"
    assert took < dist_mod.ERROR_GRACE_S, f"{took:.1f} s: some rank waited out the grace period instead"


def test_a_follow_up_decode_that_is_not_bit_exact_says_so_not_that_the_group_broke():
    """After a fault the same decode runs again: an implementation that is simply not bit-exact is named as such,
    with the ranks whose output differs from stock, not as a fault-handling failure."""
    from types import SimpleNamespace

    follow_up_error = decode_checks.follow_up_error
    placed = {"device": "cpu", "home": "cpu", "moved_by": ""}
    exact_run = [SimpleNamespace(rank=r, output=object(), sha256="a", stock_sha256="a", **placed) for r in range(3)]
    assert follow_up_error(exact_run) is None
    off = [SimpleNamespace(rank=0, output=object(), sha256="a", stock_sha256="a", **placed),
           SimpleNamespace(rank=1, output=None, sha256="", stock_sha256="", **placed),  # gather: receives nothing
           SimpleNamespace(rank=2, output=object(), sha256="b", stock_sha256="", **placed)]
    assert follow_up_error(off) == ("the decode without the fault is not bit-exact with the stock decode on ranks "
                                    "[2] (the fast path's numbers, not its fault handling: see the decode bitexact "
                                    "checks)")
    copied = [*exact_run[:2], SimpleNamespace(rank=2, output=object(), sha256="a", stock_sha256="",
                                              **{**placed, "moved_by": "Tensor.cpu()"})]
    assert follow_up_error(copied) == ("the decode without the fault is not where the stock decode leaves its video "
                                       "on ranks [2] (another device, or a CPU copy: the fast path's placement, not "
                                       "its fault handling)")


def test_a_numeric_bug_that_also_fails_the_follow_up_decode_is_headed_by_its_numbers(parity_ctx):
    """A decode that is simply wrong (its cross-fade skipped) still raises on every rank under a fault; the decode
    run again afterwards is not bit-exact, and the verdict leads with those numbers, not with "the group works"."""
    from harness.judging import ablation, catalogue, checks

    catalogue.load()
    with ablation.get("decode.crossfade_skipped").apply():
        verdict = checks.run_check(str(decode_checks.fault_id("decoder_raises")), parity_ctx)
    assert not verdict.passed
    assert verdict.headline == "parity" and verdict.metrics["parity"].startswith("max|d| ")
    assert verdict.message.startswith("the decode without the fault: "), verdict.message
    assert verdict.metrics["outcome"] == "8/8 ranks raise"  # the fault handling itself held
