"""`ember bench claims` / `ember bench switch` verdicts: a run meant to measure warm claims fails
loudly when a replica got a cold pod (no cluster: the counts are given)."""

from ember_bench.claims import claims_verdict
from ember_bench.switch import switch_verdict


def test_claims_all_warm_is_ok() -> None:
    assert claims_verdict(replicas=100, warm=100, cold=0) == "ok"


def test_claims_with_cold_pods_fail() -> None:
    verdict = claims_verdict(replicas=100, warm=97, cold=3)
    assert verdict.startswith("FAIL")
    assert "97 of 100" in verdict and "3 a cold one" in verdict


def test_claims_every_pod_cold_fails() -> None:
    assert claims_verdict(replicas=4, warm=0, cold=4).startswith("FAIL")


def test_switch_verdict_counts_missing_warm_pods() -> None:
    runs = [{"from_warm": 4, "pods": 4, "warm_expected": 4},
            {"from_warm": 1, "pods": 4, "warm_expected": 4},
            {"from_warm": 2, "pods": 4, "warm_expected": 2}]
    assert switch_verdict(runs[:1] + runs[2:]) == "ok"
    verdict = switch_verdict(runs)
    assert verdict.startswith("FAIL") and "1 of 3" in verdict and "3 cold pods" in verdict


def test_switch_from_scratch_runs_expect_no_warm_pods() -> None:
    assert switch_verdict([{"from_warm": 0, "pods": 4}]) == "ok"
