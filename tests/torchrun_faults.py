"""Items run inside ``torchrun -m pytest`` by tests/test_torchrun.py (not collected on their own): one rank faults
in the middle of a sharded decode of the tiny VAE and every other rank must raise, naming it, within the bound.

PARITY_TEST_FAULT picks the fault, PARITY_TEST_FAULT_RANK the rank, PARITY_TEST_FAULT_LOG a directory where
every rank writes what it saw (its pid, the launcher's port, when it raised and with what) for the parent
test to judge. The faults:

- raise_after_gather: the rank raises right after its payload collective returned (inside the protocol);
- raise_outside_protocol: the rank raises instead of joining the assemble status exchange, leaving the
  others inside a collective;
- sigstop / sigkill: the rank stops or kills itself in its first decoder call, before the probe exchange;
- stuck: the rank sleeps in its first decoder call (alive, its heartbeat beating, as in a deadlock or a stuck
  data loader) and never reaches the probe exchange its peers wait in;
- spin: the rank loops in Python in its first decoder call (alive, its CPU busy, computing nothing);
- slow: not a fault: every rank repeats its first decoder call for about PARITY_TEST_SLOW_S seconds of real work,
  the faulting rank three times as long, so its peers wait in the probe exchange for longer than the bound's stuck time;
  the decode must succeed on every rank, nobody named.
"""

import json
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fixtures import decode_models, decode_tasks
from harness.decode import exchange, serve, sharded
from harness.process import launch
from harness.process.dist import World, WorldTaskError
from tests import dist_tasks

SIZE = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
FAULT = os.environ.get("PARITY_TEST_FAULT", "")
FAULT_RANK = int(os.environ.get("PARITY_TEST_FAULT_RANK", "1"))
LOG = Path(os.environ.get("PARITY_TEST_FAULT_LOG", "."))
SLOW_S = float(os.environ.get("PARITY_TEST_SLOW_S", "0"))


def _note(**fields) -> None:
    path = LOG / f"rank{RANK}.json"
    seen = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**seen, **fields}))


def _fault_here():
    """Inject PARITY_TEST_FAULT on this rank (a context manager's worth of patching, undone by the caller)."""
    def stop_or_kill(tile: torch.Tensor) -> torch.Tensor:
        _note(fault_at=time.time())
        os.kill(os.getpid(), signal.SIGSTOP if FAULT == "sigstop" else signal.SIGKILL)
        raise AssertionError("unreachable: the rank was stopped or killed")

    def sleep_forever(tile: torch.Tensor) -> torch.Tensor:
        _note(fault_at=time.time())
        time.sleep(600)
        raise AssertionError("unreachable: the rank sleeps until the session ends")

    def spin_forever(tile: torch.Tensor) -> torch.Tensor:
        _note(fault_at=time.time())
        turns = 0
        while turns >= 0:
            turns += 1
        raise AssertionError("unreachable: the rank loops until the session ends")

    original_collect, original_confirm = exchange.collect, exchange.confirm

    def collect_then_raise(*args, **kwargs):
        original_collect(*args, **kwargs)
        _note(fault_at=time.time())
        raise decode_tasks.InjectedFault(f"torchrun:after-gather:rank{RANK}",
                                         f"injected fault right after the payload gather on rank {RANK}")

    def leave_at_assemble(step, *args, **kwargs):
        if step == "assemble":
            _note(fault_at=time.time())
            raise decode_tasks.InjectedFault(f"torchrun:outside-protocol:rank{RANK}",
                                             f"injected fault outside the protocol on rank {RANK}")
        return original_confirm(step, *args, **kwargs)

    return {"sigstop": ("decoder", stop_or_kill), "sigkill": ("decoder", stop_or_kill),
            "stuck": ("decoder", sleep_forever), "spin": ("decoder", spin_forever),
            "raise_after_gather": ("collect", collect_then_raise),
            "raise_outside_protocol": ("confirm", leave_at_assemble)}[FAULT]


def slow_decode_task(job: decode_tasks.TinyDecodeJob) -> tuple[str, float]:
    """Every rank decodes with its first decoder call slowed to about SLOW_S seconds, FAULT_RANK's to three times
    that, so FAULT_RANK reaches the probe exchange at least 2 SLOW_S after its peers (the calls after the first
    run at full speed: the wait is what the check is about, not the whole decode): (the video's shape, when this
    rank reached the probe exchange)."""
    vae = job.build_vae()
    z = job.build_latents(torch.device("cpu"))
    seconds = SLOW_S * (3 if dist.get_rank() == FAULT_RANK else 1)
    reached: list[float] = []
    original = exchange.exchange_probes

    def exchange_probes(*args, **kwargs):
        reached.append(time.time())
        return original(*args, **kwargs)

    exchange.exchange_probes = exchange_probes
    try:
        with torch.no_grad(), serve.bound(vae, "decoder", dist_tasks.slowed(vae.decoder, seconds, calls=1)):
            video = sharded.sharded_decode(vae, z, dist.group.WORLD)
    finally:
        exchange.exchange_probes = original
    return str(tuple(video.shape)), reached[0]


def faulty_decode_task(job: decode_tasks.TinyDecodeJob) -> str:
    vae = job.build_vae()
    z = job.build_latents(torch.device("cpu"))
    where, fault = _fault_here() if dist.get_rank() == FAULT_RANK else (None, None)
    saved = (exchange.collect, exchange.confirm)
    try:
        if where == "collect":
            exchange.collect = fault
        elif where == "confirm":
            exchange.confirm = fault
        with torch.no_grad(), (serve.bound(vae, "decoder", fault) if where == "decoder" else nullcontext()):
            video = sharded.sharded_decode(vae, z, dist.group.WORLD)
    finally:
        exchange.collect, exchange.confirm = saved
    return str(tuple(video.shape))


@pytest.fixture(scope="module")
def world():
    with World(SIZE) as launched:
        yield launched


@pytest.mark.skipif(FAULT != "slow", reason="the slow launch only")
def test_a_slow_rank_is_waited_for_and_never_called_stuck(world):
    _note(rank=RANK, pid=os.getpid(), port=int(os.environ["MASTER_PORT"]), started=time.time(), fault_at=time.time())
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))
    results = world.run(slow_decode_task, job, timeout_s=300.0)
    shapes = {shape for shape, _ in results}
    reached = [at for _, at in results]
    _note(finished_at=time.time(), shapes=sorted(shapes), reached=reached, stuck_s=launch.stuck_s())
    assert len(shapes) == 1


@pytest.mark.skipif(FAULT == "slow", reason="a fault launch only")
def test_a_fault_on_one_rank_makes_every_rank_raise_within_the_bound(world):
    _note(rank=RANK, pid=os.getpid(), port=int(os.environ["MASTER_PORT"]), bound=launch.fault_bound(),
          silence=launch.silence_s(), grace=launch.grace_s(), started=time.time())
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))
    with pytest.raises(WorldTaskError) as info:
        world.run(faulty_decode_task, job, timeout_s=300.0)
    _note(raised_at=time.time(), error=str(info.value).splitlines()[0],
          outcomes=[o.line() for o in info.value.outcomes])
    culprit = info.value.outcomes[FAULT_RANK]
    assert culprit.status in ("raised", "died", "stuck"), str(info.value)
    assert f"rank {FAULT_RANK}" in str(info.value)


@pytest.mark.skipif(FAULT == "slow", reason="a fault launch only")
def test_the_world_is_gone_or_still_usable_after_it(world):
    """After a fault inside the protocol the group still works; after one outside it the group is lost and said so.

    (After a stop or a kill this item fails on every rank at setup, naming the lost rank: the run is red.)"""
    if FAULT == "raise_after_gather":
        assert world.run(decode_tasks.decode_task, decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22)),
                         timeout_s=120.0)[RANK].sha256
    else:
        assert not world.alive and launch.lost(), "a group whose collective never finished must be given up"
    _note(finished_at=time.time())
