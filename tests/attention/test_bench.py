"""Each attention kernel against masked SDPA and against its own raw launches, at the seed's shapes (prefill S 5348;
denoise Q 4099 vs KV 5345), on the CPU (1 head, fp32) and on CUDA when present (all 8 heads).

Four arms per kernel, phase and device, timed interleaved and kept at their best round:

- ``fast``: the kernel as the harness calls it: input checks, then its layout work per call (row blocks and their
  slices, the BlockMask, the padded operands and mask) and its launches;
- ``stock``: the reference, masked SDPA, with its dense (Q, KV) mask built per call;
- ``raw``: the kernel's own launches (torch SDPA or flex_attention) on the operands the harness built, replayed
  back to back: the kernel without the harness's layout and mask construction;
- ``raw_stock``: SDPA's launch under the prebuilt dense mask.

The reference arms are timed once per phase and device, by the first kernel item that needs them. The table
also gives the (query, key) score pairs each kernel computes: the dense reference Q x KV, the decomposition's row
blocks, the BlockMask's non-empty tiles (what a fused flex kernel computes; eager flex on the CPU computes every
pair), the padded Qp x KVp. ``pytest -m bench -k attention`` (or ``-k flex``) selects it. No timed assertions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fixtures import attention_captures as seeds
from fixtures.bench_timing import bench_rounds, best_of, interleaved
from harness.attention import kernels, primitives
from harness.attention.layout import PHASES

pytestmark = pytest.mark.bench

KERNEL_NAMES = kernels.kernels_under_test()
DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
ROUNDS = bench_rounds(3)
TITLE = (f"attention kernels at the seed shapes (fp32), best of {ROUNDS} interleaved rounds: fast = the kernel as "
         "the harness calls it, stock = masked SDPA building its dense mask, raw = the kernel's own launches on "
         "the operands the harness built, raw stock = SDPA's launch under the prebuilt mask")
_REFERENCE: dict[tuple[str, str], dict[str, float]] = {}


@functools.cache
def _inputs(device: str, phase: str) -> Any:
    return seeds.phase_inputs(None, phase, device)


def _synced(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    if device != "cuda":
        return fn

    def run() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


@contextlib.contextmanager
def _launches() -> Iterator[list[Callable[[], Any]]]:
    """Every primitive launch made while the block runs, as a call of the launch itself on the same operands."""
    calls: list[Callable[[], Any]] = []
    sdpa, flex = primitives.launch_sdpa, primitives.launch_flex

    def record(launch: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append(functools.partial(launch, *args, **kwargs))
            return launch(*args, **kwargs)

        return recorded

    primitives.launch_sdpa, primitives.launch_flex = record(sdpa), record(flex)
    try:
        yield calls
    finally:
        primitives.launch_sdpa, primitives.launch_flex = sdpa, flex


def _arms(device: str, phase: str, name: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(the kernel as the harness calls it, its launches replayed on the operands it built)."""
    inputs = _inputs(device, phase)
    q, k, v = inputs.capture.heads_first()
    spec = kernels.get_kernel(name)

    def kernel() -> Any:
        return spec(q, k, v, inputs.layout, scale=inputs.capture.scale)

    with torch.no_grad(), _launches() as launches:
        kernel()
    assert launches, f"kernel {name} made no launch through harness.attention.primitives"

    def raw() -> None:
        for launch in launches:
            launch()

    return _synced(kernel, device), _synced(raw, device)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Parametrized fixtures, not parametrize marks: the marks' keyword "parametrize" would match ``-k ar``."""
    return request.param


@pytest.fixture(params=PHASES)
def phase(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=KERNEL_NAMES)
def kernel(request: pytest.FixtureRequest) -> str:
    return request.param


def test_attention_kernel_vs_sdpa_vs_raw(benchmark: Any, bench_log: Any, device: str, phase: str,
                                         kernel: str) -> None:
    with torch.no_grad():
        if (device, phase) not in _REFERENCE:
            stock, raw_stock = _arms(device, phase, "sdpa")
            _REFERENCE[(device, phase)] = best_of(interleaved({"stock": stock, "raw_stock": raw_stock}, ROUNDS))
        fast, raw = _arms(device, phase, kernel)
        times = best_of(interleaved({"fast": fast, "raw": raw}, ROUNDS, benchmark))
    inputs = _inputs(device, phase)
    layout = inputs.layout
    pairs = kernels.get_kernel(kernel).pairs(layout, kernels.BLOCK)
    row = bench_log.record("attention", TITLE, {"device": device, "phase": phase, "heads": inputs.capture.heads,
                                                "kernel": kernel},
                           extra={"pairs": f"{pairs:,}", "x dense": pairs / (layout.q_len * layout.kv_len)},
                           **times, **_REFERENCE[(device, phase)])
    benchmark.extra_info.update({f"{arm}_s": seconds for arm, seconds in row.seconds.items()},
                                **{k: v for k, v in row.ratios().items() if v is not None})
