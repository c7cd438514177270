"""`ember bench correctness`'s bookkeeping (no GPU): cases, lanes, verdicts, the report."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ember_bench.correctness import (
    ARCHITECTURES,
    Lanes,
    all_cases,
    decode_start,
    first_difference,
    markdown,
)


def test_cases_cover_the_shapes_and_skip_what_the_machine_cannot_run() -> None:
    names = {c.name: c for c in all_cases(2)}
    assert {"parallel/ep2-qwen3-moe", "parallel/tp2-llama3-8b", "parallel/dp2-llama3-8b"} <= set(names)
    assert "skip" in names["parallel/tp4-llama3-8b"].args
    assert "skip" not in names["parallel/ep2-qwen3-moe"].args
    assert sum(n.startswith("decode/") for n in names) == 8  # four workloads, eager and compiled
    cb = [n for n in names if n.startswith("cb/") and "@" not in n]
    assert len(ARCHITECTURES) >= 15 and len(cb) == len(ARCHITECTURES)
    assert all("skip" not in c.args for c in all_cases(4))


def test_a_wide_case_waits_for_enough_free_gpus() -> None:
    lanes = Lanes(["0", "1", "2", "3"])
    one = lanes.take(1)
    got: list[list[str]] = []
    t = threading.Thread(target=lambda: got.append(lanes.take(4)))
    t.start()
    time.sleep(0.1)
    assert not got  # three are free, the case needs four
    lanes.give(one)
    t.join(2)
    assert sorted(got[0]) == ["0", "1", "2", "3"]


def _rank(rank: int, tokens: bool = True, outputs: int = 3, **extra: object) -> dict:
    return {"rank": rank, "load_ms": 1.0, "tokens_identical": {"1": tokens, "8": True},
            "outputs_identical": outputs, "outputs": 3, **extra}


def test_a_start_is_wrong_if_any_rank_differs() -> None:
    assert decode_start([_rank(0), _rank(1)])["verdict"] == "identical"
    wrong = decode_start([_rank(0), _rank(1, tokens=False)])
    assert wrong["verdict"] == "wrong" and "rank 1" in wrong["why"]
    assert decode_start([_rank(0, outputs=2), _rank(1)])["verdict"] == "wrong"


def test_a_start_keeps_each_ranks_canary_cost_and_its_parts() -> None:
    parts = {"reference": 1.0, "template": 40.0}
    start = decode_start([_rank(0, verify_ms=41.0, verify_parts_ms=parts), _rank(1, verify_ms=43.0)])
    assert start["verify_ms"] == [41.0, 43.0] and start["verify_parts_ms"] == [parts, None]


def test_a_cb_start_keeps_its_canarys_cost_and_parts_and_a_refused_one_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_bench import cb, correctness

    parts = {"template": 30.0, "reset": 2.0}
    loads = iter([{"tokens": [[1, 2]], "mode": "restored", "verify_ms": 41.0, "verify_parts_ms": parts,
                   "canary_key": [0, 64, 256]},
                  {"tokens": [[1, 2]], "mode": "native", "reason": "verify: canary differs"}])

    def child(phase: str, opts: dict, out: Path, timeout: float, env: dict) -> dict:
        if phase == "save":
            return {"tokens": [[1, 2]], "archive": {"identity": "ab" * 32}}
        return next(loads) if phase == "load" else {"tokens": [[1, 2]]}

    monkeypatch.setattr(cb, "run_child", child)
    case = correctness.Case("cb/llama", "cb", 1, {"arch": "llama"})
    out = correctness.run_case(case, Lanes(["0"]), 2, tmp_path, 10.0)
    got = out["starts"]
    assert out["counts"] == {"identical": 1, "wrong": 0, "fell back": 1, "error": 0}
    assert got[0] == {"verdict": "identical", "why": "", "verify_ms": 41.0, "verify_parts_ms": parts,
                      "canary_key": [0, 64, 256]}
    assert got[1]["verdict"] == "fell back" and "canary differs" in got[1]["why"]


def test_a_refusal_on_every_failing_rank_is_a_fallback_not_an_error() -> None:
    refused = {"rank": 1, "load_error": "refused: verify: canary differs: rank 1: ..."}
    assert decode_start([_rank(0), refused])["verdict"] == "fell back"
    crashed = {"rank": 1, "load_error": "load rank 1 exited -11"}
    assert decode_start([_rank(0), crashed])["verdict"] == "error"


def test_the_first_differing_token_is_named() -> None:
    ref = [[[1, 2, 3], [4, 5, 6]], [[7, 8]]]
    got = [[[1, 2, 3], [4, 5, 6]], [[7, 9]]]
    assert first_difference(ref, got) == "wave 1 prompt 0 token 1"


def test_the_report_counts_wrong_starts_per_case() -> None:
    report = {"starts": 2, "device": "H200", "gpus": 2, "date": "d", "cases": [
        {"case": "cb/mistral", "world": 1, "wall_s": 1.0,
         "counts": {"identical": 1, "wrong": 1, "fell back": 0, "error": 0},
         "starts": [{"verdict": "identical", "why": ""},
                    {"verdict": "wrong", "why": "wave 1 prompt 7 token 9"}]},
        {"case": "parallel/tp4-llama3-8b", "world": 4, "skipped": "needs 4 GPUs, this machine has 2"},
    ]}
    md = markdown(report)
    assert "| cb/mistral | 1 | 1 / 2 | 1 | 0 | 0 | 1.0 | wave 1 prompt 7 token 9 |" in md
    assert "needs 4 GPUs" in md


def test_a_shallower_depth_reaches_the_decode_and_parallel_cases_and_the_report_names_it() -> None:
    cases = {c.name: c for c in all_cases(2, layers=8)}
    assert cases["decode/gemma3-compile"].args["layers"] == 8
    assert cases["parallel/tp2-llama3-8b"].args["layers"] == 8
    assert "layers" not in cases["cb/mistral"].args  # CB models have their own small configs
    assert all("layers" not in c.args for c in all_cases(2) if not c.name.startswith("cb/"))
    row = {"case": "decode/gemma3-compile", "world": 1, "layers": 8, "wall_s": 3.0,
           "counts": {"identical": 1, "wrong": 0, "fell back": 0, "error": 0},
           "starts": [{"verdict": "identical", "why": ""}]}
    md = markdown({"starts": 1, "device": "H200", "gpus": 1, "date": "d", "cases": [row]})
    assert "| decode/gemma3-compile (8 layers) | 1 | 0 / 1 |" in md
