"""The registry of named parity checks.

A check is a callable ``fn(ctx) -> Verdict`` or ``fn() -> Verdict`` registered once, with the policy it is
judged under, under an id that reads ``path.case.what`` (``decode.t37.w8.bitexact``; built from the
catalogue's case objects, harness.judging.checkid). The runner passes the run's ``CheckContext`` only to a check
whose signature takes it (a parameter left unbound), so a check that needs no device, world or capture
declares none. parity/, mutation/ and gpu/ all generate their tests from this one registry, so a check id
is the way in: one search finds the function that defines it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.judging.checkid import CheckId
from harness.judging.compare import Policy, Verdict
from harness.paths import path_of
from harness.registry import Registry

__all__ = ["CHECKS", "Check", "CheckContext", "all_checks", "get", "register", "run_check"]

CHECK_ID = re.compile(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_\-]+)+$")
TIERS = frozenset({"cpu", "gpu"})
READABLE = ("capture_dir",)  # the CheckContext inputs a check may declare it reads (register's ``reads``)


@dataclass
class CheckContext:
    """What a check may ask of the run: device, dtype, checkpoint, capture dir, shared worlds.

    ``task_timeout_s`` bounds every distributed task; the kill matrix lowers it for ablations
    whose bug is a hang, so the hang is detected in seconds.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    checkpoint: str | None = None
    capture_dir: str | None = None
    task_timeout_s: float = 120.0
    worlds: Any = None  # harness.process.dist.WorldPool, set by the plugin
    cache: dict[str, Any] = field(default_factory=dict)

    def world(self, size: int):
        if self.worlds is None:
            from harness.process.dist import WorldPool

            self.worlds = WorldPool(device=self.device)
        return self.worlds.get(size)


CheckFn = Callable[[CheckContext], Verdict] | Callable[[], Verdict]


def takes_context(fn: CheckFn) -> bool:
    """True when ``fn`` leaves a parameter unbound: the runner then passes it the run's CheckContext."""
    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: give it the context
        return True


@dataclass(frozen=True)
class Check:
    id: str
    fn: CheckFn
    tier: str
    doc: str
    module: str
    where: str = ""  # "module:qualname" of the function that computes it (a partial names its function)
    policy: str = ""  # what it is judged under, declared at registration (--parity-list prints it)
    takes_ctx: bool = True  # the runner passes the CheckContext only to checks whose signature takes it
    reads: tuple[str, ...] = ()  # the run inputs (CheckContext fields set from options) its verdict depends on

    @property
    def path(self) -> str:
        return path_of(self.id)


CHECKS: Registry[Check] = Registry("check id", list_known=False)


def _describe_policy(policy: Policy | Callable[..., Policy] | str | None) -> str:
    """A policy, its factory or its description, as --parity-list prints it."""
    if policy is None or isinstance(policy, str):
        return policy or ""
    if isinstance(policy, Policy):
        return policy.describe()
    target = getattr(policy, "func", policy)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"


def register(check_id: str | CheckId, *, tier: str = "cpu", doc: str = "",
             policy: Policy | Callable[..., Policy] | str | None = None,
             reads: tuple[str, ...] = ()) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn(ctx) -> Verdict`` (or ``fn() -> Verdict``) under ``check_id`` with the policy it is judged
    under; duplicate or malformed ids fail at import.

    ``reads`` names the ``CheckContext`` inputs the verdict depends on (``"capture_dir"``), so a run given that
    input knows which checks judge it and fails when none of them ran.
    """
    check_id = str(check_id)
    if not CHECK_ID.match(check_id):
        raise ValueError(f"check id {check_id!r} must read 'path.case.what' (lowercase path, dot-separated)")
    if tier not in TIERS:
        raise ValueError(f"check {check_id!r}: tier must be one of {sorted(TIERS)}, got {tier!r}")
    unknown = sorted(set(reads) - set(READABLE))
    if unknown:
        raise ValueError(f"check {check_id!r}: reads {unknown}; a check reads any of {list(READABLE)}")
    described = _describe_policy(policy)

    def decorate(fn: CheckFn) -> CheckFn:
        target = getattr(fn, "func", fn)  # a functools.partial names its function
        module = getattr(target, "__module__", "?")
        where = f"{module}:{getattr(target, '__qualname__', getattr(target, '__name__', '?'))}"
        text = doc or next(iter((target.__doc__ or "").strip().splitlines()), "")
        CHECKS.register(check_id, Check(check_id, fn, tier, text, module, where, described,
                                        takes_context(fn), tuple(reads)), origin=where)
        return fn

    return decorate


def get(check_id: str) -> Check:
    return CHECKS.get(check_id)


def exists(check_id: str) -> bool:
    return check_id in CHECKS


def all_checks(tier: str | None = None, path: str | None = None) -> list[Check]:
    return [c for c in CHECKS.values() if (tier is None or c.tier == tier) and (path is None or c.path == path)]


def run_check(check_id: str | CheckId, ctx: CheckContext) -> Verdict:
    """Run one check and stamp its registered id onto the verdict: check bodies and judges never
    carry ids. A verdict already filed under another id is a bug in the check itself."""
    check_id = str(check_id)
    check = get(check_id)
    verdict = check.fn(ctx) if check.takes_ctx else check.fn()
    if not isinstance(verdict, Verdict):
        raise TypeError(f"check {check_id!r} returned {type(verdict).__name__}, expected a Verdict")
    if not verdict.check_id:
        return dataclasses.replace(verdict, check_id=check_id)
    if verdict.check_id != check_id:
        raise ValueError(f"check {check_id!r} returned a verdict for {verdict.check_id!r}")
    return verdict
