"""ember bench graphs' TPOT goal: the restored step against torch's capture in the same process.

A process that has launched only restored graphs can run every graph with shorter gaps between
kernels, so the cross-process ratio made restored graphs look 8 % faster than native while the
graphs were not. The goal reads the same-process control when the LOAD child measured it, and
holds a difference either way against it: a restored graph faster than its own capture is a
finding, not a pass.
"""

from __future__ import annotations

from typing import Any

from ember_bench import graphs


def _report(restored: dict[str, float], native: dict[str, float], same: dict[str, Any]) -> dict[str, Any]:
    return {
        "load_ms": 10.0, "native_over_load": 100.0, "switch_ms": {}, "archive_bytes": 1,
        "tokens_identical": {}, "tpot_restored_ms": restored, "tpot_native_ms": native,
        "tpot_same_process": same,
    }


def test_the_same_process_control_decides_the_tpot_goal() -> None:
    cross_faster = ({"1": 8.92, "64": 11.43}, {"1": 9.81, "64": 12.28})
    equal_here = {"restored": {"1": 9.886, "64": 12.313}, "captured": {"1": 9.861, "64": 12.316}}
    assert graphs.goals(_report(*cross_faster, equal_here))["tpot_within_1pct"] is True

    faster_here = {"restored": {"1": 8.92, "64": 12.31}, "captured": {"1": 9.86, "64": 12.31}}
    assert graphs.goals(_report(*cross_faster, faster_here))["tpot_within_1pct"] is False
    slower_here = {"restored": {"1": 10.2, "64": 12.31}, "captured": {"1": 9.86, "64": 12.31}}
    assert graphs.goals(_report(*cross_faster, slower_here))["tpot_within_1pct"] is False


def test_without_the_control_the_cross_process_ratio_is_used() -> None:
    assert graphs.goals(_report({"1": 9.85}, {"1": 9.8}, {}))["tpot_within_1pct"] is True
    assert graphs.goals(_report({"1": 10.2}, {"1": 9.8}, {}))["tpot_within_1pct"] is False
