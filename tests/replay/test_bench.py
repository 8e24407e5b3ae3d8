"""Serial vs batched-step replay at S = 2, 4, 8 on every registered replay family's tiny model, beside the
raw model's own batching limit measured in the same run.

One item per family and S times four arms interleaved (each round runs every arm once), kept at their best
round: ``stock`` (the serial loop, one forward per step), ``fast`` (the batched path, one forward of S*cfg*B
rows), and the raw model's own limit: the very transformer calls the two paths made, replayed back to back
(``raw_stock``: the serial loop's S forwards of cfg*B rows; ``raw``: the batched path's one forward). The table
puts the batched/serial ratio next to the raw ratio (their quotient, ``vs raw``, is how close replay comes to
what the model itself gives when batched; the target is 0.9x-1.1x) and the ideal 1/S, plus the activation-memory
ratio (bytes held by one forward's module outputs: the batched forward holds about S times the serial one's).
``pytest -m bench -k cogview4`` measures and prints that family's rows only. No timed assertions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fixtures.bench_timing import bench_rounds, best_of, interleaved
from fixtures.replay_cases import bench_problem
from fixtures.replay_families import family_names
from harness.replay.judge import run_batched, run_serial
from harness.replay.problem import ReplayProblem

pytestmark = pytest.mark.bench

STEPS = (2, 4, 8)
ROUNDS = bench_rounds(15)
TITLE = (f"replay per family (B=3, CFG x2, fp32, CPU): serial (stock) vs batched-step (fast), beside the raw "
         f"model's own batching (its recorded forwards: raw stock looped, raw batched), best of {ROUNDS} "
         "interleaved rounds; ideal 1/S; act. mem = batched/serial activation bytes of one forward")


Call = tuple[tuple[Any, ...], dict[str, Any]]


@functools.cache
def _recorded(family: str, steps: int, path: str) -> tuple[Call, ...]:
    """The transformer calls one run of ``path`` makes (its positional and keyword arguments), for the raw limit;
    read before each call, so whatever a family's transformer returns."""
    run = run_serial if path == "serial" else run_batched
    module = bench_problem(steps, family).adapter.module
    calls: list[Call] = []
    handle = module.register_forward_pre_hook(lambda _m, args, kwargs: calls.append((args, dict(kwargs))),
                                              with_kwargs=True)
    try:
        with torch.no_grad():
            run(bench_problem(steps, family))
    finally:
        handle.remove()
    return tuple(calls)


def _replayed(problem: ReplayProblem, calls: tuple[Call, ...]) -> Callable[[], None]:
    """The model alone: ``calls`` replayed back to back."""
    module = problem.adapter.module

    def call() -> None:
        for args, kwargs in calls:
            module(*args, **kwargs)

    return call


def activation_bytes(problem: ReplayProblem, run: Callable) -> list[int]:
    """Bytes of every leaf module's outputs, summed per transformer forward (one entry per forward)."""
    module = problem.adapter.module
    per_forward: list[int] = []

    def start(*_):
        per_forward.append(0)

    def count(_module, _inputs, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        per_forward[-1] += sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [module.register_forward_pre_hook(start)] + [m.register_forward_hook(count) for m in leaves]
    try:
        run(problem)
    finally:
        for handle in handles:
            handle.remove()
    return per_forward


@pytest.fixture(params=family_names())
def family(request: pytest.FixtureRequest) -> str:
    """A parametrized fixture, not a parametrize mark: its keyword "parametrize" would match ``-k ar``."""
    return request.param


@pytest.fixture(params=STEPS, ids=[f"s{s}" for s in STEPS])
def steps(request: pytest.FixtureRequest) -> int:
    return request.param


def test_replay_serial_vs_batched(benchmark: Any, bench_log: Any, family: str, steps: int) -> None:
    problem = bench_problem(steps, family)
    with torch.no_grad():
        times = best_of(interleaved({
            "stock": lambda: run_serial(problem),
            "fast": lambda: run_batched(problem),
            "raw_stock": _replayed(problem, _recorded(family, steps, "serial")),
            "raw": _replayed(problem, _recorded(family, steps, "batched")),
        }, ROUNDS, benchmark))
        _, serial_forwards = run_serial(problem)
        _, batched_forwards = run_batched(problem)
        serial_peak = max(activation_bytes(problem, run_serial))
        batched_peak = max(activation_bytes(problem, run_batched))
    row = bench_log.record("replay", TITLE, {"family": family, "S": steps}, ideal=1 / steps,
                           extra={"forwards": f"{len(serial_forwards)}->{len(batched_forwards)}",
                                  "rows": max(batched_forwards), "act. mem": batched_peak / serial_peak}, **times)
    benchmark.extra_info.update({f"{arm}_s": seconds for arm, seconds in times.items()}, **row.extra,
                                **{k: v for k, v in row.ratios().items() if v is not None})
