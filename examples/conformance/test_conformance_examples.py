"""The zoo's implementations against the suite's own reference, directly (no --impl): the right ones agree,
each bug is where it says it is. Fast unit checks; ``zoo.py`` then judges every implementation the way a
team would, through ``pytest -m cpu --impl``.

Run from the repository root (``fixtures`` is the suite's checkout, not installed).
"""

import pytest
import torch
import zoo_ar
import zoo_attention
import zoo_replay

from fixtures import ar_models
from fixtures.ar_cases import CASES
from fixtures.replay_cases import fake_problem
from harness.ar.left_padded import fast_left_rollout, left_padded_batch
from harness.attention.layout import AttentionLayout
from harness.attention.reference import masked_sdpa
from harness.judging.compare import close, exact
from harness.plugins import conformance
from harness.replay.replay import replay_batched as suite_replay_batched

pytestmark = pytest.mark.cpu

LAYOUTS = [AttentionLayout(40, 96, 3, "prefill", images=((4, 20),)), AttentionLayout(40, 96, 3, "denoise")]


def _qkv(layout, kv_heads):
    gen = torch.Generator().manual_seed(layout.q_len)
    q = torch.randn(1, 4, layout.q_len, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, layout.kv_len, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, layout.kv_len, 16, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.phase)
def test_attend_is_the_reference_and_causal_only_is_not(layout, kv_heads):
    q, k, v = _qkv(layout, kv_heads)
    expected = masked_sdpa(q, k, v, layout)
    policy = close(atol=1e-12, rtol=0.0, reason="fp64: the same masked SDPA, summation order only")
    right = policy.judge(zoo_attention.attend(q, k, v, layout), expected)
    assert right.passed, right.describe()
    wrong = policy.judge(zoo_attention.causal_only(q, k, v, layout), expected)
    assert not wrong.passed and wrong.metrics["max_abs"] > 1e-3, wrong.describe()


@pytest.mark.parametrize(("bug", "inside", "outside"), [
    ("drops_the_scale", {"scale": 0.0625}, {"scale": None}),
    ("flattens_heads_apart", {"batch": 2}, {"batch": 1}),
    ("gqa_group_two", {"heads": 8}, {"heads": 4}),
])
def test_each_input_space_bug_is_right_outside_its_class(bug, inside, outside):
    """The zoo's dropped scale, batch and heads flattened apart and hard-coded GQA group agree with the reference
    (fp64, summation order only) everywhere but on their one input class."""
    layout = LAYOUTS[0]
    policy = close(atol=1e-12, rtol=0.0, reason="fp64: the same masked SDPA, summation order only")
    for where, agrees in ((outside, True), (inside, False)):
        shape = {"batch": 2, "heads": 8, "scale": 0.0625, **where}
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(shape["batch"], shape["heads"], layout.q_len, 16, generator=gen, dtype=torch.float64)
        k, v = torch.randn(2, shape["batch"], 2, layout.kv_len, 16, generator=gen, dtype=torch.float64).unbind(0)
        verdict = policy.judge(getattr(zoo_attention, bug)(q, k, v, layout, scale=shape["scale"]),
                               masked_sdpa(q, k, v, layout, scale=shape["scale"]))
        assert verdict.passed == agrees, f"{bug} at {where}: {verdict.describe()}"


@pytest.mark.parametrize("name", ["cfg1", "cfg2", "uncond_first", "list_payloads"])
def test_replay_is_the_suite_replay_and_the_swapped_nesting_is_not_under_cfg(name):
    problem = fake_problem(name)
    expected = suite_replay_batched(*problem.args())
    right = zoo_replay.replay_batched(*problem.args())
    swapped = zoo_replay.nesting_swapped(*problem.args())
    for what in ("log_probs", "prev_sample_means"):
        verdict = exact().judge(getattr(right, what), getattr(expected, what))
        assert verdict.passed, verdict.describe()
        same = exact().judge(getattr(swapped, what), getattr(expected, what)).passed
        # fused cond-first CFG splits the batch at its midpoint: only there does the nesting change the rows
        fused_cfg = name in ("cfg2", "list_payloads")
        assert same != fused_cfg, f"{name}: the swapped nesting {'survived' if same else 'differed'}"


@pytest.mark.parametrize("model", ["fake", "qwen3"])
def test_the_left_padded_rollout_is_the_suites_and_each_left_bug_is_not(model):
    """The zoo's left-padded rollout, written apart from harness.ar.left_padded, runs the very same forwards; each
    left-padded bug changes the log-probs; the layout each declares is the one a conformance run reads."""
    case = next(c for c in CASES if c.name == "unequal_real_pos")
    backend = ar_models.backend(model)
    batch = left_padded_batch(case.prompts(), ar_models.PAD_ID)
    expected = fast_left_rollout(backend, batch, case.max_new_tokens, (7,))
    right = zoo_ar.fast_left_rollout(backend, batch, case.max_new_tokens, (7,))
    for what in ("tokens", "logp", "lengths"):
        verdict = exact().judge(getattr(right, what), getattr(expected, what))
        assert verdict.passed, verdict.describe()
    assert conformance.declared_layout("ar", zoo_ar.fast_left_rollout) == "left"
    assert conformance.declared_layout("ar", zoo_ar.left_padding_undeclared) == "right"
    assert conformance.declared_layout("ar", zoo_ar.right_padding_declared_left) == "left"
    # the fake's positions are its per-row write slots: decode there goes on from each row's own slot regardless
    bugs = [name for name in zoo_ar.BUGS if name.startswith("left_") and name != "left_padding_undeclared"
            and not (model == "fake" and name == "left_positions_from_shared_cache_position")]
    # a pad's query row that admits no key is NaN only under an eager -inf softmax (SDPA gives it zeros)
    eager = ar_models.backend(model, "eager")
    on_eager = fast_left_rollout(eager, batch, case.max_new_tokens, (7,))
    for name in bugs:
        run, reference = (eager, on_eager) if name == "left_pad_queries_admit_nothing" else (backend, expected)
        wrong = getattr(zoo_ar, name)(run, batch, case.max_new_tokens, (7,))
        differs = wrong.logp.shape != reference.logp.shape or not torch.allclose(wrong.logp, reference.logp,
                                                                                  rtol=0.0, atol=1e-3)
        assert differs, f"{name} gives the right log-probs on {model}"


def test_every_zoo_module_names_a_right_implementation_and_at_least_five_bugs():
    import zoo
    import zoo_ar
    import zoo_decode

    for path, module in {"replay": zoo_replay, "ar": zoo_ar, "decode": zoo_decode, "attention": zoo_attention}.items():
        assert callable(getattr(module, zoo.PATHS[path])), path
        assert len(module.BUGS) >= 5, f"{path}: {len(module.BUGS)} bugs"
        assert all(callable(getattr(module, name)) for name in module.BUGS), path
        assert all(flaws != module.CORRECT for flaws, _ in module.BUGS.values()), path
        assert all(callable(getattr(module, name)) for name in getattr(module, "MORE_CORRECT", {})), path
