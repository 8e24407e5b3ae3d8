"""Serial vs batched-step replay at S = 2, 4, 8 on every registered replay family's tiny model, beside the
raw model's own batching limit measured in the same run.

pytest-benchmark times each path. For each family and S the raw limit replays the very transformer
calls the two paths made: the S forwards of cfg*B rows of the serial loop, called back to back
(``raw_loop``), against the one forward of S*cfg*B rows of the batched path (``raw_batched``). The table
prints the batched/serial time ratio next to that raw ratio (their quotient is how close replay comes to
what the model itself gives when batched; the target is 0.9x-1.1x) and the ideal 1/S, plus the
activation-memory ratio (bytes held by one forward's module outputs: the batched forward holds about S
times the serial one's). No timed assertions: these are measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from fixtures.bench_timing import wall_times
from fixtures.replay_cases import bench_problem
from fixtures.replay_families import family_names
from harness.replay.judge import run_batched, run_serial
from harness.replay.pipeline_oracle import Forward, record_forwards
from harness.replay.problem import ReplayProblem

pytestmark = pytest.mark.bench

STEPS = (2, 4, 8)
ROUNDS = 15
FAMILIES = family_names()
MEASURED: dict[tuple[str, str, int], dict[str, float]] = {}


@functools.cache
def _recorded(family: str, steps: int, path: str) -> tuple[Forward, ...]:
    """The transformer calls one run of ``path`` makes (bound arguments), for the raw limit."""
    run = run_serial if path == "serial" else run_batched
    with torch.no_grad(), record_forwards(bench_problem(steps, family).adapter.module) as calls:
        run(bench_problem(steps, family))
    return tuple(calls)


def _raw(path: str) -> Callable[[ReplayProblem, str, int], object]:
    """The model alone: the recorded calls of the serial loop (``raw_loop``) or the batched path."""
    def call(problem: ReplayProblem, family: str, steps: int) -> None:
        module = problem.adapter.module
        for forward in _recorded(family, steps, "serial" if path == "raw_loop" else "batched"):
            module(**forward.arguments)
    return call


PATHS: dict[str, Callable[..., object]] = {
    "serial": lambda problem, family, steps: run_serial(problem),
    "batched": lambda problem, family, steps: run_batched(problem),
    "raw_loop": _raw("raw_loop"),
    "raw_batched": _raw("raw_batched"),
}


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


def _record(family: str, path: str, steps: int, seconds: float) -> None:
    problem = bench_problem(steps, family)
    MEASURED[(family, path, steps)] = {"seconds": seconds}
    if path in ("serial", "batched"):
        run = run_serial if path == "serial" else run_batched
        _, forwards = run(problem)
        MEASURED[(family, path, steps)].update(forwards=len(forwards), rows=max(forwards),
                                               activation_peak=max(activation_bytes(problem, run)))


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_time(benchmark, family, path, steps):
    problem = bench_problem(steps, family)
    with torch.no_grad():
        benchmark.pedantic(PATHS[path], args=(problem, family, steps), rounds=ROUNDS, warmup_rounds=2, iterations=1)
    stats = getattr(benchmark, "stats", None)
    seconds = stats.stats.min if stats is not None else min(
        wall_times(functools.partial(PATHS[path], problem, family, steps), ROUNDS))
    _record(family, path, steps, seconds)
    benchmark.extra_info.update({k: v for k, v in MEASURED[(family, path, steps)].items() if k != "seconds"})


def test_replay_serial_vs_batched_table():
    lines = ["", "replay per family (B=3, CFG x2, fp32, CPU): serial vs batched-step beside the raw model's own "
                 f"batching (its recorded forwards, looped vs batched), best of {ROUNDS} rounds"]
    lines.append(f"{'family':<16} {'S':>2} {'serial ms':>10} {'batched ms':>11} {'ratio':>7} {'raw loop ms':>12} "
                 f"{'raw batch ms':>13} {'raw ratio':>10} {'vs raw':>7} {'ideal 1/S':>10} {'act. mem':>9}")
    for family in FAMILIES:
        for steps in STEPS:
            for path in PATHS:
                if (family, path, steps) not in MEASURED:
                    problem = bench_problem(steps, family)
                    with torch.no_grad():
                        best = min(wall_times(functools.partial(PATHS[path], problem, family, steps), ROUNDS))
                    _record(family, path, steps, best)
            m = {path: MEASURED[(family, path, steps)] for path in PATHS}
            ratio = m["batched"]["seconds"] / m["serial"]["seconds"]
            raw = m["raw_batched"]["seconds"] / m["raw_loop"]["seconds"]
            lines.append(f"{family:<16} {steps:>2} {m['serial']['seconds'] * 1e3:>10.2f} "
                         f"{m['batched']['seconds'] * 1e3:>11.2f} {ratio:>7.3f} "
                         f"{m['raw_loop']['seconds'] * 1e3:>12.2f} "
                         f"{m['raw_batched']['seconds'] * 1e3:>13.2f} {raw:>10.3f} {ratio / raw:>7.2f} "
                         f"{1 / steps:>10.3f} "
                         f"{m['batched']['activation_peak'] / m['serial']['activation_peak']:>9.2f}")
    print("\n".join(lines))
