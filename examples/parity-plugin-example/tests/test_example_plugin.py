"""The installed plugin as the suite sees it: found through the entry point, and judged like the suite's own.

The suite generates its whole replay catalogue for the family (``pytest -m cpu -k pixart_example`` in the
suite's checkout runs it, with the kill matrix); these tests prove the out-of-tree path from the package's
side. ``harness.judging.catalogue.load()`` imports the suite's catalogue modules (parity/, mutation/, gpu/), which
live in the suite's checkout, not in the installed package: it needs the checkout on sys.path.
"""

import importlib.metadata

import pytest
import torch
from parity_plugin_example import kernels, pixart

from harness.attention.layout import AttentionLayout
from harness.attention.reference import masked_sdpa
from harness.inputs import checkpoints
from harness.judging import catalogue, checks
from harness.judging.compare import close
from harness.plugins import entry_points as plugins
from harness.replay.guards import ReplayConfig
from harness.replay.replay import replay_batched, replay_serial
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import FlowGRPOSDE
from harness.replay.spy import spy_forwards

BATCH, STEPS, SDE_INDICES, TARGET = 2, 6, (0, 2, 3), (0, 2, 3)


def test_the_entry_point_registers_the_family_its_checkpoint_kind_and_the_kernel():
    names = {p.name for p in importlib.metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)}
    assert "parity_plugin_example" in names, f"the package is not installed with its entry point: {sorted(names)}"
    assert plugins.REPLAY_FAMILIES.get("pixart_example") is pixart.FAMILY
    assert plugins.ATTENTION_KERNELS.get("row_chunked_example") is kernels.row_chunked
    assert plugins.CHECKPOINT_KINDS.origin("pixart_example") == "parity-plugin-example"
    assert checkpoints.kind_for_family("replay", "pixart_example") is pixart.CHECKPOINT_KIND


def test_a_saved_checkpoint_is_detected_and_loaded_as_the_family(tmp_path):
    pixart.tiny_pixart().save_pretrained(tmp_path / "pixart")
    found = checkpoints.detect(tmp_path / "pixart")
    assert (found.kind, found.feeds, found.family) == ("pixart_example", "replay", "pixart_example")
    model = checkpoints.load_model(found, torch.float32, "cpu")
    assert type(model).__name__ == "PixArtTransformer2DModel"


@pytest.mark.parametrize("cfg", [1, 2])
def test_batched_replay_matches_serial_on_every_row_and_step(cfg):
    family = pixart.FAMILY
    adapter = family.adapter(pixart.tiny_pixart())
    conditions = family.example_conditions(adapter, BATCH, cfg, torch.Generator().manual_seed(cfg))
    strategy = FlowGRPOSDE(eta=0.7)
    segment = rollout(adapter, conditions, strategy, flow_sigmas(STEPS), SDE_INDICES, adapter.latent_shape,
                      generator=torch.Generator().manual_seed(10 + cfg), guidance=4.5)
    config = ReplayConfig(batch_replay_steps=True)
    serial = replay_serial(adapter, conditions, segment, strategy, TARGET, 4.5, config)
    with spy_forwards(adapter.module) as spy:
        batched = replay_batched(adapter, conditions, segment, strategy, TARGET, 4.5, config)
    assert batched is not None, "the batched path declined"
    rows = len(TARGET) * cfg * BATCH
    assert spy.batch_sizes == [rows], f"one forward of S*cfg*B = {rows} rows, got {spy.batch_sizes}"
    # fp32 GEMMs of S*cfg*B rows vs cfg*B rows: the reduction order may differ; measured ~1e-6 here
    policy = close(atol=1e-4, rtol=1e-4, reason="fp32 tiny PixArt, batched vs serial GEMM reduction order")
    for what in ("log_probs", "prev_sample_means"):
        verdict = policy.judge(getattr(batched, what),
                               getattr(serial, what), what=what)
        print(verdict.describe())
        assert verdict.passed, verdict.describe()
        assert verdict.metrics["total"] == getattr(serial, what).numel()


def test_the_suite_generates_its_replay_catalogue_for_the_family():
    catalogue.load()  # the suite's checkout must be importable (run-examples puts it on PYTHONPATH)
    ids = {c.id for c in checks.all_checks("cpu") if "pixart_example" in c.id}
    assert {"replay.pixart_example.cfg1.log_probs", "replay.pixart_example.cfg2.prev_sample_means",
            "replay.pixart_example.cfg2.replay_determinism", "replay.oracle.pipeline.pixart_example"} <= ids, ids


@pytest.mark.parametrize("layout", [AttentionLayout(70, 96, 3, "prefill"), AttentionLayout(70, 96, 3, "denoise")],
                         ids=["prefill", "denoise"])
def test_the_kernel_matches_the_reference_on_every_row(layout):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, layout.q_len, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, layout.kv_len, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, layout.kv_len, 16, generator=gen, dtype=torch.float64)
    verdict = close(atol=1e-12, rtol=0.0, reason="fp64: only summation order differs").judge(
        kernels.row_chunked(q, k, v, layout), masked_sdpa(q, k, v, layout))
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["total"] == q.numel()
