"""Serial vs batched-step replay on the tiny SD3 (CFG, uncond-first) at S = 2, 4, 8.

pytest-benchmark times each path; the table beside it gives the forward count, the batched/serial
time ratio (best of 15 rounds, robust to a
shared machine) against the ideal 1/S, and the activation-memory ratio (bytes held by one forward's
module outputs: the batched forward holds about S times the serial one's, DESIGN 1.1).
No timed assertions: these are measurements.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fixtures.bench_timing import wall_times
from fixtures.replay_cases import bench_problem
from harness.replay.parity import run_batched, run_serial
from harness.replay.problem import ReplayProblem

pytestmark = pytest.mark.bench

STEPS = (2, 4, 8)
PATHS = {"serial": run_serial, "batched": run_batched}
MEASURED: dict[tuple[str, int], dict[str, float]] = {}


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


def _best_seconds(fn: Callable[[], object], rounds: int = 15) -> float:
    return min(wall_times(fn, rounds))


def _record(path: str, steps: int, seconds: float) -> None:
    problem = bench_problem(steps)
    _, forwards = PATHS[path](problem)
    MEASURED[(path, steps)] = {"seconds": seconds, "forwards": len(forwards), "rows": max(forwards),
                               "activation_peak": max(activation_bytes(problem, PATHS[path]))}


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_replay_time(benchmark, path, steps):
    problem = bench_problem(steps)
    with torch.no_grad():
        benchmark.pedantic(PATHS[path], args=(problem,), rounds=15, warmup_rounds=2, iterations=1)
    stats = getattr(benchmark, "stats", None)
    seconds = stats.stats.min if stats is not None else _best_seconds(lambda: PATHS[path](problem))
    _record(path, steps, seconds)
    benchmark.extra_info.update({k: v for k, v in MEASURED[(path, steps)].items() if k != "seconds"})


def test_replay_serial_vs_batched_table():
    lines = ["", "replay on tiny SD3 (B=3, CFG x2, fp32, CPU): serial vs batched-step, best of 15 rounds",
             f"{'S':>3} {'serial ms':>10} {'fwd':>4} {'batched ms':>11} {'fwd':>4} {'rows':>5} "
             f"{'ratio':>7} {'ideal 1/S':>10} {'act. mem ratio':>15}"]
    for steps in STEPS:
        for path in PATHS:
            if (path, steps) not in MEASURED:
                problem = bench_problem(steps)
                with torch.no_grad():
                    _record(path, steps, _best_seconds(lambda p=problem, f=PATHS[path]: f(p)))
        serial, batched = MEASURED[("serial", steps)], MEASURED[("batched", steps)]
        lines.append(f"{steps:>3} {serial['seconds'] * 1e3:>10.2f} {serial['forwards']:>4} "
                     f"{batched['seconds'] * 1e3:>11.2f} {batched['forwards']:>4} {batched['rows']:>5} "
                     f"{batched['seconds'] / serial['seconds']:>7.3f} {1 / steps:>10.3f} "
                     f"{batched['activation_peak'] / serial['activation_peak']:>15.2f}")
    print("\n".join(lines))
