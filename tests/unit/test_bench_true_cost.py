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
        "warm_launchable_ms": {"first": first - 4, "p50": first + 2, "all": first + 5},
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
def _variant(ready: tuple[float, ...], templates: float) -> list[dict[str, Any]]:
    return [{"cold_first_ms": 60, "cold_templates_ms": templates, "cold_ready_ms": a, "cold_all_ms": a + 3,
             "cold_build_ms": 500} for a in ready]


# Three variants, whatever the module measures today: a role with its env changed.
VARIANTS = {
    "cold_early": ("cold", {"EMBER_DEDICATE_EARLY": "1"}),
    "cold_switch_5ms": ("cold", {"EMBER_SWITCH_INTERVAL_US": "0"}),
    "warm_slow_reads": ("warm", {"EMBER_NATIVE_READ": "0"}),
}
VARIANT_RUNS = {
    "cold_early": _variant((520, 560, 480), 70),
    "cold_switch_5ms": _variant((900, 950, 990), 400),
    "warm_slow_reads": [{**w, "warm_first_ms": w["warm_first_ms"] + 50} for w in RUNS["warm"]],
}


@pytest.fixture(autouse=True)
def two_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "VARIANTS", VARIANTS)


def _fake(runs: dict[str, list[dict[str, Any]]]) -> Any:
    taken = {k: iter(v) for k, v in {**runs, **VARIANT_RUNS}.items()}

    def run(name: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
        # the same role, another env: which variant is told by the env alone
        variant = [v for v, (role, changed) in true_cost.VARIANTS.items() if changed.items() <= env.items()]
        if variant:
            assert true_cost.VARIANTS[variant[0]][0] == name  # the variant's role ran
        return {"role": name, **next(taken[variant[0] if variant else name])}

    return run


def test_medians_and_the_cold_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "run_child", _fake(RUNS))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert (out["warm_first_ms"], out["warm_ready_ms"], out["warm_all_ms"]) == (7, 30, 32)
    assert out["build_only_ms"] == 400 and out["cold_ready_ms"] == 700
    assert out["build_only_range_ms"] == [300, 480]  # the bare builds' own spread, reported beside
    assert out["cold_extra_ms"] == 300  # median restored process (every key ready) minus median bare build
    assert out["cold_extra_first_ms"] == 60 - 400
    # the restoring process's build (median 450) against a bare one (400); after it, per run 250,
    # 80, 100: the median of the per-run tails (100), not a difference of medians (700 - 450)
    assert out["cold_build_slowdown_ms"] == 50 and out["cold_after_build_ms"] == 100
    # each variant: the cold runs with its env, against the same bare builds
    assert out["cold_early_ready_ms"] == 520 and out["cold_early_extra_ms"] == 120
    assert out["cold_switch_5ms_ready_ms"] == 950 and out["cold_switch_5ms_extra_ms"] == 550
    assert out["cold_switch_5ms_templates_ms"] == 400 and out["cold_templates_ms"] == 70
    # per variant the same split: builds of 500 ms, then per run 20, 60, -20 ms → median 20
    assert out["cold_early_build_ms"] == 500 and out["cold_early_after_build_ms"] == 20
    assert all(len(out["runs"][v]) == 3 for v in true_cost.VARIANTS)
    # a warm variant: the warm figures of its runs (first key 50 ms later in each)
    assert out["warm_slow_reads_first_ms"] == out["warm_first_ms"] + 50
    assert out["warm_slow_reads_ready_ms"] == out["warm_ready_ms"] and "warm_slow_reads_extra_ms" not in out
    # launchable (template ready) before run: medians over the runs' first (5, 1, 3) and median keys
    assert out["warm_launchable_first_ms"] == 3 and out["warm_launchable_p50_ms"] == 9
    assert out["first_use_extra_p99_ms"] == 0.05  # the worst run's p99, not a median
    assert out["warm_first_use_updates"] == 0 and out["warm_exec_mb"] == 90.0
    assert len(out["runs"]["warm"]) == 3 and "error" not in out


def test_a_failed_child_is_an_error_not_a_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {**RUNS, "cold": [{"error": "exited 1", "stderr": "boom"}, *RUNS["cold"][1:]]}
    monkeypatch.setattr(true_cost, "run_child", _fake(runs))
    out = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert out["error"]["error"] == "exited 1"
    assert "cold_extra_ms" not in out and "warm_all_ms" not in out


def test_the_true_cost_goals_read_the_medians_and_the_worst_p99(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "run_child", _fake(RUNS))
    g = true_cost.goals(true_cost.measure("file:///s", "h" * 64, {}, repeats=3))
    assert g["warm_every_key_own_exec<=150ms"] is True  # median 30 ms
    assert g["warm_first_key<=30ms"] is True and g["first_use_no_exec_update"] is True
    assert g["warm_first_key_launchable<=30ms"] is True and g["warm_every_key_launchable<=150ms"] is True
    assert g["cold_extra<=150ms"] is False  # 300 ms
    assert g["first_use_p99<=0.1ms"] is True  # worst run 0.05 ms
    assert true_cost.goals({"error": "exited 1"}) == {}


def test_the_report_line_names_each_variant_and_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(true_cost, "run_child", _fake(RUNS))
    tc = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    line = true_cost.report_line(
        {"workload": "llama3-8b", "true_cost": tc, "native_over_warm_load": 5.0,
         "native_over_cold_load": 9.0, "load_ms": 10.8}
    )
    assert "vs a bare build 400 ms (runs 300-480 ms): LOAD adds 300 ms (its build ends +50 ms later" in line
    assert "first key launchable 3 ms, run 7 ms; half the keys launchable 9 ms" in line
    assert (
        "cold_switch_5ms (EMBER_SWITCH_INTERVAL_US=0): adds +550 ms (its build ends +100 ms later, then "
        "450 ms), templates at 400 ms"
    ) in line
    assert "cold_early (EMBER_DEDICATE_EARLY=1): adds +120 ms (its build ends +100 ms later, then 20 ms)" \
        in line
    assert "warm_slow_reads (EMBER_NATIVE_READ=0): first key 57 ms, every template" in line


def test_the_cold_difference_with_each_runs_torch_import_taken_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # bare builds 400/480/300 ms of which imports took 100/180/0: alike once those are out
    imports = {"build": (100, 180, 0), "cold": (90, 150, 300)}
    timed = {role: [{**r, "torch_import_ms": t} for r, t in zip(RUNS[role], imports[role], strict=True)]
             for role in imports}
    runs = {**RUNS, **timed}
    monkeypatch.setattr(true_cost, "run_child", _fake(runs))
    tc = true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
    assert tc["cold_extra_ms"] == 300  # unchanged: medians of whole runs
    assert tc["build_less_import_range_ms"] == [300, 300]
    # restored runs less their imports: 610, 350, 500 → median 500; bare builds: 300
    assert tc["cold_extra_less_import_ms"] == 200
    line = true_cost.report_line({"workload": "llama3-8b", "true_cost": tc, "native_over_warm_load": 5.0,
                                  "native_over_cold_load": 9.0, "load_ms": 10.8})
    assert ("LOAD adds 300 ms (200 ms with each run's torch import taken out, bare builds then "
            "300-300 ms) (its build ends") in line
    monkeypatch.setattr(true_cost, "run_child", _fake(RUNS))  # children that did not time it: no such figure
    assert "cold_extra_less_import_ms" not in true_cost.measure("file:///s", "h" * 64, {}, repeats=3)
