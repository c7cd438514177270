"""ember bench graphs' true-cost figures: medians over fresh processes and the cold difference.

The children need a GPU; `_run` (one child) is replaced by canned results so what is tested is
the arithmetic the README's headline rests on, and that a failed child is reported, not averaged.
"""

from __future__ import annotations

from typing import Any

import pytest

from ember_bench import true_cost

RUNS = {
    "warm": [
        {"warm_first_ms": f, "warm_all_ms": a, "warm_settled_ms": a + 1}
        for f, a in ((9, 30), (5, 20), (7, 90))
    ],
    "cold": [{"cold_first_ms": 60, "cold_all_ms": a, "cold_settled_ms": a} for a in (700, 500, 800)],
    "build": [{"build_ms": b} for b in (400, 480, 300)],
}


def _fake(runs: dict[str, list[dict[str, Any]]]) -> Any:
    taken = {k: iter(v) for k, v in runs.items()}

    def run(name: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
        return {"role": name, **next(taken[name])}

    return run


def test_medians_and_the_cold_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "_run", _fake(RUNS))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert (out["warm_first_ms"], out["warm_all_ms"], out["warm_settled_ms"]) == (7, 30, 31)
    assert out["build_only_ms"] == 400 and out["cold_all_ms"] == 700
    assert out["cold_extra_ms"] == 300  # median restored process minus median bare build
    assert len(out["runs"]["warm"]) == 3 and "error" not in out


def test_a_failed_child_is_an_error_not_a_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {**RUNS, "cold": [{"error": "exited 1", "stderr": "boom"}, *RUNS["cold"][1:]]}
    monkeypatch.setattr(true_cost, "_run", _fake(runs))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert out["error"]["error"] == "exited 1"
    assert "cold_extra_ms" not in out and "warm_all_ms" not in out
