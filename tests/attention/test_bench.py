"""Each attention kernel against masked SDPA at the seed's shapes (prefill S 5348; denoise Q 4099 vs
KV 5345), on the CPU (1 head, fp32) and on CUDA when present (all 8 heads).

pytest-benchmark times each kernel; the table beside it gives the time ratio to the reference and
the (query, key) score pairs each kernel computes: the dense reference Q x KV, the decomposition's
row blocks, the BlockMask's non-empty 128 x 128 tiles (what a fused flex kernel computes; eager
flex on the CPU computes every pair), the padded Qp x KVp. No timed assertions: measurements.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from fixtures import attention_captures as seeds
from fixtures.bench_timing import wall_times
from harness.attention import kernels
from harness.attention.layout import PHASES

pytestmark = pytest.mark.bench

KERNEL_NAMES = ("sdpa", "decomposed", "flex", "block_padded")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MEASURED: dict[tuple[str, str, str], dict[str, float]] = {}


def _call(device: str, phase: str, name: str):
    inputs = seeds.phase_inputs(None, phase, device)
    q, k, v = inputs.capture.heads_first()
    spec = kernels.get_kernel(name)

    def run():
        out = spec(q, k, v, inputs.layout, scale=inputs.capture.scale)
        if q.is_cuda:
            torch.cuda.synchronize()
        return out

    return run, inputs


def _median_seconds(fn, rounds: int = 3) -> float:
    return statistics.median(wall_times(fn, rounds))


def _record(device: str, phase: str, name: str, seconds: float) -> None:
    _, inputs = _call(device, phase, name)
    layout = inputs.layout
    pairs = kernels.get_kernel(name).pairs(layout, kernels.BLOCK)
    MEASURED[(device, phase, name)] = {"seconds": seconds, "pairs": pairs,
                                       "dense": layout.q_len * layout.kv_len, "heads": inputs.capture.heads}


@pytest.mark.parametrize("name", KERNEL_NAMES)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("device", DEVICES)
def test_attention_kernel_time(benchmark, device, phase, name):
    run, _ = _call(device, phase, name)
    with torch.no_grad():
        benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    _record(device, phase, name, stats.stats.median if stats is not None else _median_seconds(run))
    benchmark.extra_info.update({k: v for k, v in MEASURED[(device, phase, name)].items() if k != "seconds"})


def test_attention_kernels_vs_reference_table(capsys):
    lines = ["", "attention kernels vs masked SDPA at the seed shapes (fp32)",
             f"{'device':>6} {'phase':>8} {'heads':>5} {'kernel':>13} {'ms':>9} {'x sdpa':>7} "
             f"{'pairs':>12} {'x dense':>8}"]
    for device in DEVICES:
        for phase in PHASES:
            for name in KERNEL_NAMES:
                if (device, phase, name) not in MEASURED:
                    run, _ = _call(device, phase, name)
                    with torch.no_grad():
                        _record(device, phase, name, _median_seconds(run))
            reference = MEASURED[(device, phase, "sdpa")]["seconds"]
            for name in KERNEL_NAMES:
                row = MEASURED[(device, phase, name)]
                lines.append(f"{device:>6} {phase:>8} {row['heads']:>5} {name:>13} {row['seconds'] * 1e3:>9.1f} "
                             f"{row['seconds'] / reference:>7.2f} {row['pairs']:>12,} "
                             f"{row['pairs'] / row['dense']:>8.3f}")
    with capsys.disabled():
        print("\n".join(lines))
