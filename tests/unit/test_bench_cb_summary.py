"""`ember bench cb` verdicts from phase results (no GPU: the phases' JSON is given)."""

from __future__ import annotations

from ember_bench.cb import summarize

GOAL = "claim -> first token <= 1 s (restored)"


def _phases(mode: str, claim_s: float) -> dict[str, dict]:
    tokens = [[1, 2, 3]]
    return {
        "native": {"start_to_first_token_s": 8.0, "process_to_first_token_s": 23.0, "tokens": tokens,
                   "captures_while_serving": 8},
        "save": {"captures_while_serving": 0, "tokens": tokens},
        "load": {"start_to_first_token_s": 0.4, "process_to_first_token_s": 15.4, "tokens": tokens,
                 "captures_while_serving": 0},
        "claim-restored": {"mode": mode, "reason": "", "claim_to_first_token_s": claim_s, "tokens": tokens},
    }


def test_a_fast_restored_claim_meets_the_goal() -> None:
    s = summarize(_phases("restored", 0.6))
    assert s["goals"][GOAL] is True
    assert s["goals"]["restored start <= 1/10 of native"] is True  # 0.4 s vs 8 s


def test_a_claim_that_fell_back_to_native_does_not_meet_it_however_fast() -> None:
    s = summarize(_phases("native", 0.6))
    assert s["goals"][GOAL] is False
    assert s["claim_restored_mode"] == "native"


def test_a_slow_restored_claim_misses_it() -> None:
    assert summarize(_phases("restored", 1.3))["goals"][GOAL] is False


def test_the_start_ratio_from_the_process_start_counts_the_model_build() -> None:
    s = summarize(_phases("restored", 0.6))
    assert s["process_restored_over_native"] == 15.4 / 23.0
    assert s["goals"]["process start -> first token <= 1/10 of native"] is False  # the build is not restored
    s = summarize({k: {kk: vv for kk, vv in v.items() if kk != "process_to_first_token_s"}
                   for k, v in _phases("restored", 0.6).items()})
    assert s["goals"]["process start -> first token <= 1/10 of native"] is None  # not measured, not passed


def _run(first: float, opened: float, built: float) -> dict:
    return {"process_to_first_token_s": first, "start_to_first_token_s": 0.1,
            "process_marks_s": {"started": 0.1, "imported": 4.0, "opened": opened, "built": built}}


def test_repeated_processes_give_medians_and_the_ratio_follows_them() -> None:
    phases = _phases("restored", 0.6)
    phases["process"] = {
        "native": [_run(15.0, 4.5, 14.0), _run(14.0, 4.4, 13.5), _run(20.0, 4.6, 19.0)],
        "load": [_run(17.0, 7.0, 16.5), _run(18.0, 7.2, 17.8), _run(16.0, 6.9, 15.0)],
        "load_early": [_run(15.5, 7.0, 15.0), {"error": "timed out after 600s"}],
    }
    s = summarize(phases)
    med = s["process_medians"]
    assert med["native"] == {"runs": 3, "to_first_token_s": 15.0, "before_build_s": 4.5, "build_s": 9.5,
                             "to_first_token_range_s": [14.0, 20.0]}
    assert med["load"]["to_first_token_s"] == 17.0 and med["load"]["build_s"] == 9.5
    assert med["load_early"]["runs"] == 1  # a failed run is left out, not counted as a figure
    # the medians decide the ratio, not the single phase runs (15.4 / 23.0)
    assert s["process_restored_over_native"] == 17.0 / 15.0
    assert s["goals"]["process start -> first token <= 1/10 of native"] is False
    assert "process" not in s["errors"]


def test_the_restored_starts_report_their_canary_and_the_repeats_its_spread() -> None:
    phases = _phases("restored", 0.6)
    phases["load"]["verify_ms"] = 61.0
    phases["process"] = {"native": [_run(15.0, 4.5, 14.0)],
                         "load": [{**_run(17.0, 7.0, 16.5), "verify_ms": v} for v in (70.0, 40.0, 55.0)]}
    s = summarize(phases)
    assert s["restored_verify_ms"] == 61.0 and "verify_ms" not in s["process_medians"]["native"]
    assert s["process_medians"]["load"]["verify_ms"] == {"min": 40.0, "median": 55.0, "max": 70.0}
