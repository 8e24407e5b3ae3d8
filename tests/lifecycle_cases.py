"""An item run by tests/test_lifecycle.py in a pytest of its own (not collected on its own): a world of four ranks
decodes the tiny VAE for a long time, forked or under torchrun, each rank writing its pid to PARITY_TEST_NOTES
once it is mid-decode, so the test can stop the run right there and count what is left."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from fixtures import decode_models, decode_tasks
from harness.decode import serve, sharded
from harness.process.dist import World
from tests import dist_tasks

SIZE = int(os.environ.get("WORLD_SIZE", "4"))
NOTES = Path(os.environ.get("PARITY_TEST_NOTES", "."))


def long_decode_task(job: decode_tasks.TinyDecodeJob, seconds: float) -> str:
    vae = job.build_vae()
    z = job.build_latents(torch.device("cpu"))
    (NOTES / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    with torch.no_grad(), serve.bound(vae, "decoder", dist_tasks.slowed(vae.decoder, seconds)):
        video = sharded.sharded_decode(vae, z, dist.group.WORLD)
    return str(tuple(video.shape))


def test_a_long_sharded_decode():
    with World(SIZE) as world:
        world.run(long_decode_task, decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22)), 120.0,
                  timeout_s=600.0)
