"""`ember bench graphs --tp/--ep/--dp` report: both LOAD figures, said for what they are."""

from __future__ import annotations

from ember_bench.parallel import markdown


def test_the_report_shows_every_template_and_the_hand_over_apart() -> None:
    rank = {"rank": 0, "native_capture_s": 6.01, "load_ms": 470.7, "load_first_ms": 12.3, "splice_ms": 7.0,
            "collectives": 296, "collective_capture_ms": 6.5, "native_over_load": 12.8,
            "tokens_identical": {"1": True, "8": False}, "outputs_identical": 66, "outputs": 67}
    report = {"device": "NVIDIA H200", "date": "2026-11-24", "result": {
        "workload": "llama3-8b", "layers": "model", "shape": {}, "world": 1, "archive_bytes": 31.6e6,
        "graphs": 67, "save_s": 44.2, "save_capture_s": 5.74, "ranks": [rank]}}
    md = markdown(report)
    row = next(line for line in md.splitlines() if line.startswith("| 0 |"))
    assert "| 470.7 (12.3) |" in row and "B=8: NO" in row and "66/67" in row
    assert "until every template is instantiated" in md and "handed over" in md
