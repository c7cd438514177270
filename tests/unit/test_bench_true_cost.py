"""ember bench graphs' true-cost figures: medians over fresh processes and the cold difference.

The children need a GPU; `_run` (one child) is replaced by canned results so what is tested is
the arithmetic the README's headline rests on, and that a failed child is reported, not averaged.
"""

from __future__ import annotations

from typing import Any

import pytest

from ember_bench import true_cost


def _warm(first: float, ready: float, p99: float) -> dict[str, Any]:
    return {
        "warm_first_ms": first, "warm_templates_ms": first + 5, "warm_ready_ms": ready,
        "warm_all_ms": ready + 2, "warm_first_use_extra_ms": {"p50": 0.01, "p99": p99, "max": p99},
        "warm_first_use_updates": 0, "warm_exec_mb": 90.0, "warm_execs": 42, "warm_exec_capped": 0,
    }


RUNS = {
    "warm": [_warm(f, a, p) for f, a, p in ((9, 30, 0.02), (5, 20, 0.05), (7, 90, 0.03))],
    "cold": [
        {"cold_first_ms": 60, "cold_templates_ms": 70, "cold_ready_ms": a, "cold_all_ms": a + 3,
         "cold_build_ms": b}
        for a, b in ((700, 450), (500, 420), (800, 700))
    ],
    "build": [{"build_ms": b} for b in (400, 480, 300)],
}
EARLY = [{"cold_first_ms": 60, "cold_templates_ms": 70, "cold_ready_ms": a, "cold_all_ms": a + 3,
          "cold_build_ms": 500} for a in (520, 560, 480)]


def _fake(runs: dict[str, list[dict[str, Any]]]) -> Any:
    taken = {k: iter(v) for k, v in {**runs, "cold_early": EARLY}.items()}

    def run(name: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
        early = env.get("EMBER_DEDICATE_EARLY") == "1"  # the same role, another env
        return {"role": name, **next(taken["cold_early" if early else name])}

    return run


def test_medians_and_the_cold_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "_run", _fake(RUNS))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert (out["warm_first_ms"], out["warm_ready_ms"], out["warm_all_ms"]) == (7, 30, 32)
    assert out["build_only_ms"] == 400 and out["cold_ready_ms"] == 700
    assert out["cold_extra_ms"] == 300  # median restored process (every key ready) minus median bare build
    assert out["cold_extra_first_ms"] == 60 - 400
    # the restoring process's build (median 450) against a bare one (400); after it, per run 250,
    # 80, 100: the median of the per-run tails (100), not a difference of medians (700 - 450)
    assert out["cold_build_slowdown_ms"] == 50 and out["cold_after_build_ms"] == 100
    assert out["cold_early_ready_ms"] == 520 and out["cold_early_extra_ms"] == 120  # runs with the env
    assert out["first_use_extra_p99_ms"] == 0.05  # the worst run's p99, not a median
    assert out["warm_first_use_updates"] == 0 and out["warm_exec_mb"] == 90.0
    assert len(out["runs"]["warm"]) == 3 and "error" not in out


def test_a_failed_child_is_an_error_not_a_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {**RUNS, "cold": [{"error": "exited 1", "stderr": "boom"}, *RUNS["cold"][1:]]}
    monkeypatch.setattr(true_cost, "_run", _fake(runs))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert out["error"]["error"] == "exited 1"
    assert "cold_extra_ms" not in out and "warm_all_ms" not in out


def test_the_true_cost_goals_read_the_medians_and_the_worst_p99(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "_run", _fake(RUNS))
    g = true_cost.goals(true_cost.measure("file:///s", "h" * 64, {}, repeats=3))
    assert g["warm_every_key_own_exec<=150ms"] is True  # median 30 ms
    assert g["warm_first_key<=30ms"] is True and g["first_use_no_exec_update"] is True
    assert g["cold_extra<=150ms"] is False  # 300 ms
    assert g["first_use_p99<=0.1ms"] is True  # worst run 0.05 ms
    assert true_cost.goals({"error": "exited 1"}) == {}
