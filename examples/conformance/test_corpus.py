"""The corpus of reported bugs (``examples/conformance/corpus``), checked directly (no --impl): every entry is
complete, and every re-creation really differs from the zoo's right implementation on a small input, so a
conformance failure in ``zoo.py --corpus`` is the flaw's and not a broken module's.

Each path has a few probe inputs; an entry must change the output (or raise, or hang a world where the right
implementation returns) on at least one of them. Run from the repository root, as ``examples/run-examples`` does.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zoo
from corpus import PATHS, Report

from fixtures import ar_cases, ar_models, decode_models, decode_tasks, replay_cases
from harness.ar.left_padded import left_padded_batch
from harness.attention.layout import AttentionLayout
from harness.plugins import conformance

pytestmark = pytest.mark.cpu

URL = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")
MIN_ENTRIES = 15
MIN_MECHANISM_WORDS = 40  # a paragraph, not a title


def _reports(path: str) -> dict[str, Report]:
    return importlib.import_module(f"corpus.{path}").REPORTS


ENTRIES = [(path, name) for path in PATHS for name in _reports(path)]


def _ids(entry: tuple[str, str]) -> str:
    return f"{entry[0]}:{entry[1]}"


@functools.cache
def _catalogue(path: str) -> frozenset[str]:
    return frozenset(zoo.catalogue(path))


def _differs(right: Any, wrong: Any) -> bool:
    """True when two outputs differ beyond the rounding of the same computation (shapes, values, None-ness)."""
    if isinstance(right, torch.Tensor) and isinstance(wrong, torch.Tensor):
        if right.shape != wrong.shape:
            return True
        return not torch.allclose(right.double(), wrong.double(), rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(right, (tuple, list)) and isinstance(wrong, (tuple, list)):
        return len(right) != len(wrong) or any(_differs(a, b) for a, b in zip(right, wrong, strict=True))
    return (right is None) != (wrong is None)


def _outcome(call: Callable[[], Any]) -> Any:
    """What a call gives: its result, or the exception type's name when it raises."""
    try:
        return call()
    except (ValueError, RuntimeError) as err:  # WorldError (a rank raised, or the world hung) among them
        return f"raised {type(err).__name__}"


def _first_difference(path: str, name: str, probes: dict[str, Callable[[str], Any]]) -> str | None:
    """The first probe on which the entry and the zoo's right implementation differ, or None."""
    right_spec = f"zoo_{path}:{zoo.PATHS[path]}"
    for probe, run in probes.items():
        right = _right(path, probe, run, right_spec)
        assert not isinstance(right, str), f"probe {probe}: the right implementation {right}"
        wrong = _outcome(lambda run=run: run(f"corpus.{path}:{name}"))
        if isinstance(wrong, str) or _differs(right, wrong):
            return probe
    return None


_RIGHT: dict[tuple[str, str], Any] = {}


def _right(path: str, probe: str, run: Callable[[str], Any], spec: str) -> Any:
    """The right implementation's outcome on a probe, computed once per session."""
    if (path, probe) not in _RIGHT:
        _RIGHT[(path, probe)] = _outcome(lambda: run(spec))
    return _RIGHT[(path, probe)]


# ------------------------------------------------------------------------------------------ metadata


def test_the_corpus_has_enough_reports_on_every_path():
    assert len(ENTRIES) >= MIN_ENTRIES, f"{len(ENTRIES)} reports; at least {MIN_ENTRIES} expected"
    assert {path for path, _ in ENTRIES} == set(PATHS), "every path has reported bugs"
    assert len({report.url for path in PATHS for report in _reports(path).values()}) == len(ENTRIES), \
        "each entry is its own report"


@pytest.mark.parametrize("entry", ENTRIES, ids=_ids)
def test_every_report_is_complete(entry):
    path, name = entry
    report = _reports(path)[name]
    zoo_module = importlib.import_module(f"zoo_{path}")
    assert URL.match(report.url), f"{name}: {report.url!r} is not a GitHub issue or pull request"
    assert report.project.strip() and report.version.strip(), f"{name}: project and version"
    assert len(report.mechanism.split()) >= MIN_MECHANISM_WORDS, f"{name}: the mechanism is one paragraph"
    assert report.recreation.strip(), f"{name}: say how the flaw is re-created in the signature"
    assert isinstance(report.flaws, type(zoo_module.CORRECT)) and report.flaws != zoo_module.CORRECT, \
        f"{name}: carries exactly the zoo's flaws type, with a flaw set"
    assert callable(getattr(importlib.import_module(f"corpus.{path}"), name)), f"{name}: no callable of that name"
    assert name not in zoo_module.BUGS, f"{name}: a corpus name must not shadow a zoo bug"
    assert report.checks, f"{name}: declare the checks expected to catch it"
    unknown = [c for c in report.checks if c not in _catalogue(path)]
    assert not unknown, f"{name}: {unknown} are not CPU checks of the {path} path"
    unjudged = [c for c in report.checks if conformance.judged_by(c) is not None]
    assert not unjudged, f"{name}: {unjudged} are not judged under --impl, so they cannot catch it"


# ------------------------------------------------------------------------------------------ attention

# two earlier images (each its own bidirectional block), KV 139 (no block multiple), 4 query heads over 2
ATTENTION_LAYOUT = AttentionLayout(40, 96, 3, "prefill", images=((4, 16), (20, 36)))


def _attention_probe(spec: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    kv = ATTENTION_LAYOUT.kv_len
    q = torch.randn(1, 4, ATTENTION_LAYOUT.q_len, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, kv, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, kv, 16, generator=gen, dtype=torch.float64)
    return conformance.load_callable(spec)(q, k, v, ATTENTION_LAYOUT)  # scale=None: the default


# ------------------------------------------------------------------------------------------ replay


def _replay_probe(family: str, cfg: int, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    result = conformance.load_callable(spec)(*replay_cases.real_problem(family, cfg).args())
    return result.log_probs, result.prev_sample_means


REPLAY_PROBES = {f"{family}.cfg{cfg}": functools.partial(_replay_probe, family, cfg)
                 for family, cfg in (("sd3", 1), ("sd3", 2), ("flux", 1))}


# ------------------------------------------------------------------------------------------ ar


@functools.cache
def _ar_eos(backend: str) -> tuple[int, ...]:
    """The token the right rollout gives row 0 at its second step: as EOS, row 0 stops while the others go on."""
    case = next(c for c in ar_cases.CASES if c.name == "unequal_real_pos")
    right = conformance.load_callable("zoo_ar:fast_rollout")(ar_models.backend(backend), case.batch(),
                                                              case.max_new_tokens, ())
    return (int(right.tokens[0, 1]),)


def _ar_probe(backend: str, spec: str) -> tuple[torch.Tensor, ...]:
    """The probe case in the layout the implementation declares (a left-padded one gets the same prompts
    left-padded), read back layout-free: the same numbers a right one gives, when it is right."""
    case = next(c for c in ar_cases.CASES if c.name == "unequal_real_pos")
    rollout = conformance.load_callable(spec)
    batch = case.batch()
    if conformance.declared_layout("ar", rollout) == "left":
        batch = left_padded_batch(case.prompts(), ar_models.PAD_ID)
    out = rollout(ar_models.backend(backend), batch, case.max_new_tokens, _ar_eos(backend))
    return out.tokens, out.logp, out.lengths, *out.kv


AR_PROBES = {backend: functools.partial(_ar_probe, backend) for backend in ("qwen3", "fake")}


# ------------------------------------------------------------------------------------------ decode

DECODE_JOBS = {
    "subgroups_gather_dst1.w4": (4, decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22), transport="gather",
                                                                dst=1, groups=((0, 1), (2, 3)))),
    "all_gather.w2": (2, decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))),
    "more_ranks_than_clips.w8": (8, decode_tasks.TinyDecodeJob(decode_models.LatentSpec(9))),
}
DECODE_TIMEOUT_S = 30.0


def _decode_probe(ctx: Any, probe: str, spec: str) -> list[torch.Tensor | None]:
    size, job = DECODE_JOBS[probe]
    world = ctx.world(size)  # started before the spec is set: a rank forked under it would keep it
    with conformance.applied({"decode": spec}):
        results = world.run(decode_tasks.decode_task, job, False, timeout_s=DECODE_TIMEOUT_S)
    return [r.output for r in results]


# ------------------------------------------------------------------------------------------ every entry differs


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e[0] != "decode"], ids=_ids)
def test_every_recreation_differs_from_the_right_implementation(entry):
    path, name = entry
    probes = {"attention": {"prefill.two_images.kv139.gqa2.scale_none": _attention_probe},
              "replay": REPLAY_PROBES, "ar": AR_PROBES}[path]
    assert _first_difference(path, name, probes) is not None, \
        f"{path}:{name} gives what the right implementation gives on every probe ({', '.join(probes)})"


@pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e[0] == "decode"], ids=_ids)
def test_every_decode_recreation_differs_from_the_right_implementation(entry, parity_ctx):
    running = conformance.active("decode")
    if running is not None:  # this test puts its own implementations under test; never touch the run's
        pytest.skip(f"--impl decode={running}: this test drives the conformance slot itself")
    path, name = entry
    probes = {probe: functools.partial(_decode_probe, parity_ctx, probe) for probe in DECODE_JOBS}
    assert _first_difference(path, name, probes) is not None, \
        f"{path}:{name} gives what the right implementation gives on every probe ({', '.join(probes)})"
