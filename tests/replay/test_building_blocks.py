"""The replay's small pieces: the timestep convention, the forward spy, step-major unstacking, the serial
loop's fresh solver state, the batch-shape control on the fake kernel, and the determinism check's
refusal of a fast path that declines."""

from __future__ import annotations

import pytest
import torch

from fixtures.replay_cases import BATCH, fake_problem
from harness.judging.compare import exact
from harness.plugins import conformance
from harness.replay import tiling
from harness.replay.conditions import Conditions
from harness.replay.controls import FastShapeAdapter, measure_batch_shape_control
from harness.replay.denoiser import DenoiserAdapter, WrappedAdapter
from harness.replay.guards import ReplayConfig
from harness.replay.judge import compare_replay, compare_replay_determinism, judge_result
from harness.replay.replay import replay, replay_batched, replay_serial
from harness.replay.sde import MultistepSDE
from harness.replay.spy import spy_forwards

pytestmark = pytest.mark.cpu


def test_timestep_is_sigma_times_1000():
    assert DenoiserAdapter().timestep(torch.tensor([1.0, 0.5, 0.0])).tolist() == [1000.0, 500.0, 0.0]


class _Echo(torch.nn.Module):
    def forward(self, *args, **kwargs):
        return args


def test_spy_counts_rows_of_the_first_tensor_and_stops_at_exit():
    module = _Echo()
    with spy_forwards(module) as spy:
        module(torch.zeros(3, 2))
        module(7, torch.zeros(5))
        module(x=torch.zeros(2, 1))
        module(torch.tensor(1.0))
        module("no tensor")
    assert (spy.batch_sizes, spy.calls) == ([3, 5, 2, -1, -1], 5)
    module(torch.zeros(4))
    assert spy.calls == 5 and not module._forward_pre_hooks


def test_unstack_step_major_is_a_contiguous_row_step_layout():
    flat = torch.arange(12.0).reshape(6, 2)  # S=3 steps of B=2 rows
    out = tiling.unstack_step_major(flat, 3, 2)
    assert out.is_contiguous() and out.tolist() == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]
    log_probs = tiling.reshape_log_probs(torch.arange(6.0), 3, 2)
    assert log_probs.is_contiguous() and log_probs.tolist() == [[0, 2, 4], [1, 3, 5]]


def test_replay_results_are_contiguous_on_both_paths():
    problem = fake_problem("cfg1")
    for result in (replay_serial(*problem.args()), replay_batched(*problem.args())):
        assert result.log_probs.is_contiguous() and result.prev_sample_means.is_contiguous()


def test_serial_replay_forgets_a_stateful_strategy_history():
    problem = fake_problem("cfg1")
    used = MultistepSDE()
    replay_serial(*problem.with_(strategy=used, target=(3, 4)).args())
    again = replay_serial(*problem.with_(strategy=used, target=(4,)).args())
    fresh = replay_serial(*problem.with_(strategy=MultistepSDE(), target=(4,)).args())
    assert torch.equal(again.log_probs, fresh.log_probs)


def test_fast_shape_adapter_runs_the_fast_paths_batch_and_keeps_the_current_steps_block():
    """The fake kernel is batch-shape invariant: the kept rows are bitwise the plain forward's, at S x N rows."""
    problem = fake_problem("cfg1")
    x, t = torch.randn(BATCH, 4, 4, 4, generator=torch.Generator().manual_seed(0)), torch.full((BATCH,), 500.0)
    for steps in (1, 3):
        adapter = FastShapeAdapter(problem.adapter, steps)
        with spy_forwards(problem.adapter.module) as spy:
            outs = [adapter.forward(x, t, problem.conditions) for _ in range(steps)]
        assert spy.batch_sizes == [steps * BATCH] * steps
        assert all(torch.equal(out, problem.adapter.forward(x, t, problem.conditions)) for out in outs)


class _Positions(WrappedAdapter):
    """Answers each row with its position in the forward's batch: what a kept row reveals is where it ran."""

    def forward(self, hidden, timestep, conditions):
        return torch.arange(hidden.shape[0], dtype=torch.float32)[:, None].expand(hidden.shape[0], 2)


def test_fast_shape_adapter_keeps_call_k_at_block_k_of_each_branch():
    """Branch-major outside, step-major inside (the fast path's layout): with 3 steps and 2 branches of 2 rows,
    call k keeps rows [2k, 2k + 1] of branch 0 (rows 0..5) and [6 + 2k, 6 + 2k + 1] of branch 1."""
    adapter = FastShapeAdapter(_Positions(fake_problem("cfg1").adapter), 3)
    fused = Conditions(batch=2, rows={"label": torch.arange(4)}, cfg_factor=2)
    kept = [adapter.forward(torch.zeros(4, 2), torch.zeros(4), fused)[:, 0].tolist() for _ in range(4)]
    assert kept == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11], [0, 1, 6, 7]]  # the fourth call starts over
    with pytest.raises(ValueError, match="does not split into 2 CFG branches"):
        adapter.forward(torch.zeros(3, 2), torch.zeros(3), fused)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        FastShapeAdapter(adapter, 0)


def test_control_on_the_fake_kernel_measures_a_zero_floor():
    problem = fake_problem("cfg1")
    default, two = measure_batch_shape_control(problem), measure_batch_shape_control(problem, 2)
    assert (default.factor, two.factor) == (problem.steps, 2)
    assert default.max_deviation("log_probs") == 0.0 and two.max_deviation("prev_sample_means") == 0.0


_RUNS: list[int] = []


def second_call_declines(*args):
    """A fast replay that answers its first call and declines (None) on the next."""
    _RUNS.append(1)
    return replay_batched(*args) if len(_RUNS) % 2 else None


def test_determinism_check_fails_when_one_run_declines():
    if conformance.active("replay") is not None:
        pytest.skip("--impl replay: this test drives the conformance slot itself")
    _RUNS.clear()
    conformance.use("replay", f"{__name__}:second_call_declines")
    try:
        verdict = compare_replay_determinism(fake_problem("cfg1"))
    finally:
        conformance.clear()
    assert not verdict.passed
    assert verdict.violated_facts == ["batched replay returned a result on both runs (no silent fallback)"]


def test_replay_takes_the_batched_path_when_it_may_and_the_serial_loop_otherwise():
    problem = fake_problem("cfg1")
    for config, forwards in ((ReplayConfig(True), [problem.batched_rows]),
                             (ReplayConfig(), [problem.serial_rows] * problem.steps)):
        with spy_forwards(problem.adapter.module) as spy:
            result = replay(*problem.with_(config=config).args())
        assert spy.batch_sizes == forwards
        assert torch.equal(result.log_probs, replay_serial(*problem.args()).log_probs)


def test_compare_replay_fails_a_declined_fast_path_and_a_wrong_shape():
    problem = fake_problem("cfg1")
    declined = compare_replay(problem.with_(config=ReplayConfig()), exact())
    assert not declined.passed
    assert declined.violated_facts == ["batched replay returned a result (no silent fallback)"]
    assert declined.metrics["batched_forwards"] == "[]"
    shape = judge_result(exact(), torch.zeros(2, 3), torch.zeros(3, 2), (0, 1), "log_probs")
    assert not shape.passed and shape.violated_facts == ["log_probs has the serial shape [3, 2]"]
    assert (shape.metrics["actual_shape"], shape.metrics["expected_shape"]) == ("[2, 3]", "[3, 2]")


def test_the_spy_counts_the_rows_of_a_tensor_or_of_a_list_of_row_tensors():
    from harness.replay import spy as replay_spy

    assert replay_spy._rows(torch.zeros(3, 2)) == 3
    assert replay_spy._rows([torch.zeros(2), torch.zeros(5)]) == 2  # ragged rows, one tensor each
    assert replay_spy._rows([]) is None and replay_spy._rows(torch.tensor(1.0)) is None
