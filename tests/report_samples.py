"""Small parity reports in the JSON shape, built by hand: every kind of row a picture must draw (a margin, an
exact 0, facts only, a failure, an infinite kill, a fact kill, a survivor, floor marks, growth curves), so the
pictures and compare-reports are tested without running the suite."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["flipped", "sample"]


def _check(check_id: str, status: str, margin: Any, tolerance: float | None = 1e-6, **metrics: Any) -> dict[str, Any]:
    return {"id": check_id, "path": check_id.partition(".")[0], "where": "", "status": status,
            "passed": status == "passed", "metrics": metrics, "policy": "close", "margin": margin,
            "headline": "max_abs" if "max_abs" in metrics else None, "tolerance": tolerance, "violated": []}


def _kill(check: str, margin: Any, mode: str = "tolerance", status: str = "killed") -> dict[str, Any]:
    return {"check": check, "status": status, "killed": status == "killed", "mode": mode, "declared": mode,
            "margin": margin, "how": mode, "headline": "", "metrics": {}}


def _ablation(name: str, kills: list[dict[str, Any]]) -> dict[str, Any]:
    statuses = {k["status"] for k in kills}
    status = next((s for s in ("failed", "survived", "skipped") if s in statuses), "killed")
    return {"name": name, "path": name.partition(".")[0], "kill_mode": "tolerance", "status": status, "kills": kills}


def sample() -> dict[str, Any]:
    """A passing report over two paths, with floors, growth curves and every kind of kill."""
    floors = {"floor_measured": 2e-7, "floor_minimum": 4.8e-7, "floor_ceiling": 3.3e-5, "tolerance_bound": 1.9e-6}
    checks = [
        _check("replay.cfg2.log_probs", "passed", 0.125, 1.9e-6, max_abs=2.4e-7, **floors),
        _check("replay.cfg2.replay_determinism", "passed", 0.0, 0.0, max_abs=0.0),
        _check("replay.guard.flag_off", "passed", None, None),
        _check("replay.sd3.growth.prev_sample_means", "passed", 0.5, 2.4, max_abs=1.19,
               error_curve=[7.5e-8, 7.5e-8, 8.7e-8, 9e-8, 9.1e-8, 9.9e-8],
               floor_curve=[7.5e-8, 7.6e-8, 8.6e-8, 9e-8, 9.2e-8, 9.8e-8], floor_minimum=1.0),
        _check("ar.fake.unequal_real_pos.logp", "passed", 0.04, 1.5e-5, max_abs=6e-7, floor_measured=0.0,
               floor_minimum=1.4e-6, floor_ceiling=3.2e-4, tolerance_bound=1.5e-5),
        _check("ar.fake.growth.logp", "passed", 0.6, 2.0, max_abs=1.2,
               error_curve=[1e-7, 1.2e-7, 1.5e-7, 2e-7, 2.1e-7, 2.6e-7],
               floor_curve=[1e-7, 1.1e-7, 1.4e-7, 1.8e-7, 2e-7, 2.2e-7]),
        {**_check("ar.gpu.batched_vs_b1", "skipped", None, None), "reason": "no --checkpoint"},
    ]
    ablations = [
        _ablation("replay.sigma_scalar", [_kill("replay.cfg2.log_probs", 3.1e4),
                                          _kill("replay.sd3.growth.prev_sample_means", "inf")]),
        _ablation("replay.flag_ignored", [_kill("replay.guard.flag_off", None, mode="fact")]),
        _ablation("ar.decode_mask_removed", [_kill("ar.fake.unequal_real_pos.logp", 2.2e5),
                                             _kill("ar.fake.growth.logp", None, mode="raises")]),
    ]
    pairs = [k for a in ablations for k in a["kills"]]
    summary = {"checks": len(checks), "passed": 6, "failed": 0, "skipped": 1, "ablations": len(ablations),
               "killed": len(ablations), "pairs": len(pairs), "pairs_killed": len(pairs), "pairs_survived": 0,
               "pairs_failed": 0, "pairs_skipped": 0}
    return {"host": {"torch": "2.13.0+cpu", "cpu_capability": "AVX512", "aten_cpu_capability": "auto",
                     "mkl": {"version": "2024.2-Product", "cbwr": "auto"},
                     "onednn": {"version": "v3.12.0", "max_cpu_isa": "auto"},
                     "cpu": {"model": "a test CPU", "vector_flags": ["avx2"], "machine": "x86_64"}, "threads": 2,
                     "device": {"type": "cpu"}, "python": "3.11.7"},
            "checks": checks, "ablations": ablations, "summary": summary}


def flipped() -> dict[str, Any]:
    """``sample()`` after a change that broke one check and let one ablation survive, and moved a margin."""
    report = copy.deepcopy(sample())
    logp = next(c for c in report["checks"] if c["id"] == "ar.fake.unequal_real_pos.logp")
    logp.update(status="failed", passed=False, margin=3.5)
    growth = next(c for c in report["checks"] if c["id"] == "replay.sd3.growth.prev_sample_means")
    growth["margin"] = 0.05
    sigma = next(a for a in report["ablations"] if a["name"] == "replay.sigma_scalar")
    sigma["kills"][0].update(status="survived", killed=False, margin=0.9)
    sigma["status"] = "survived"
    report["summary"].update(passed=5, failed=1, killed=2, pairs_killed=4, pairs_survived=1)
    return report
