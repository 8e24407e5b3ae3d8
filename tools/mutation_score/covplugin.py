"""pytest plugin for the coverage pass: which test executes which line, ranks and caches included.

Each test runs under its own coverage context (its node id). Two kinds of work would otherwise be
credited to the wrong test or to none:
- world tasks run in forked ranks: each task is wrapped so the rank switches to the sending test's
  context (coverage restarts in a forked rank through ``patch = fork``);
- a ``functools.cache`` entry is computed once, by the first test that asks: the computation runs
  under a ``cache:<name>`` context, and every test that later calls that function inherits its lines.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["TaggedTask", "cache_label", "current_context", "switch"]

_STATE: dict[str, Any] = {"context": "", "cache_uses": defaultdict(set), "tests": {}}


def current_context() -> str:
    return _STATE["context"]


def switch(context: str) -> str:
    """Switch the coverage context of this process; return the previous one."""
    import coverage

    previous = _STATE["context"]
    _STATE["context"] = context
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(context)
    return previous


class TaggedTask:
    """A world task that runs under the context of the test that sent it (pickled by reference)."""

    def __init__(self, fn: Callable[..., Any], context: str):
        self.fn = fn
        self.context = context
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        self.__name__ = getattr(fn, "__name__", self.__qualname__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        previous = switch(self.context)
        try:
            return self.fn(*args, **kwargs)
        finally:
            switch(previous)


def _tag_world_tasks() -> None:
    from harness.process import dist

    run = dist.World.run

    @functools.wraps(run)
    def tagged_run(self: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return run(self, TaggedTask(fn, current_context()), *args, **kwargs)

    dist.World.run = tagged_run


def _track_caches(roots: tuple[str, ...]) -> None:
    """Replace every project-level functools cache by a wrapper that credits its computation."""
    modules = [m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in roots]
    wrappers: dict[int, Callable[..., Any]] = {}
    for module in modules:
        for attr, value in list(vars(module).items()):
            if not (hasattr(value, "cache_clear") and hasattr(value, "__wrapped__") and callable(value)):
                continue
            if id(value) not in wrappers:
                value.cache_clear()  # filled at collection: recomputed under a test, so its lines are credited
                wrappers[id(value)] = _tracked(value, cache_label(value))
            setattr(module, attr, wrappers[id(value)])


def cache_label(cached: Any) -> str:
    """The name of a functools cache in the coverage map (the engine clears caches by it)."""
    return f"cache:{cached.__module__}.{cached.__qualname__}"


def _tracked(cached: Any, label: str) -> Callable[..., Any]:
    @functools.wraps(cached)
    def call(*args: Any, **kwargs: Any) -> Any:
        _STATE["cache_uses"][label].add(current_context())
        previous = switch(label)
        try:
            return cached(*args, **kwargs)
        finally:
            switch(previous)

    # the whole cache interface, so code that finds caches by it (an ablation of stock code swaps every cache for
    # an empty one of the same function, harness.judging.ablation.fresh_caches) finds this one and its function
    call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    call.cache_info = cached.cache_info  # type: ignore[attr-defined]
    call.cache_parameters = cached.cache_parameters  # type: ignore[attr-defined]
    call.__wrapped__ = cached.__wrapped__  # type: ignore[attr-defined]
    return call


class CoveragePass:
    """Registered by ``tools.mutation_score.coverage_map`` in the coverage subprocess."""

    def __init__(self, roots: tuple[str, ...], out: Path):
        self.roots = roots
        self.out = out

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        _tag_world_tasks()
        _track_caches(self.roots)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        previous = switch(item.nodeid)
        began = time.perf_counter()
        _STATE["tests"][item.nodeid] = {"passed": True, "duration": 0.0}
        try:
            yield
        finally:
            _STATE["tests"][item.nodeid]["duration"] = time.perf_counter() - began
            switch(previous)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = _STATE["tests"].setdefault(report.nodeid, {"passed": True, "duration": 0.0})
        if report.failed or (report.when == "call" and report.skipped):
            entry["passed"] = False

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        uses = {label: sorted(contexts) for label, contexts in _STATE["cache_uses"].items()}
        self.out.write_text(json.dumps({"tests": _STATE["tests"], "cache_uses": uses}))
