"""CPU: `ember bench vllm-switch` plans its GPUs, refuses a machine that cannot run the switch (and
says why in its report), reads the old shape's service per window and judges the goals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ember_bench import vllm_switch as vs
from ember_bench import vllm_switch_report as rep
from ember_bench.vllm_switch_plan import Shape, plan, shape, visible_gpus, window


def test_shapes_from_tp_and_ep() -> None:
    assert shape(1, 2) == Shape(tensor=1, data=2, expert=True) and shape(1, 2).world == 2
    assert shape(2, 4) == Shape(tensor=2, data=2, expert=True)
    assert shape(2, 1) == Shape(tensor=2) and shape(2, 1).name == "tp2"
    assert shape(1, 4).name == "ep4-dp4" and shape(1, 1).world == 1
    with pytest.raises(ValueError, match="multiple of tensor"):
        shape(2, 3)


def test_four_gpus_ep2_to_ep4_share_the_old_shapes_gpus() -> None:
    p = plan(shape(1, 2), shape(1, 4), ["0", "1", "2", "3"], 0.35)
    assert p.refusals == ()
    assert p.old_gpus == ("0", "1") and p.new_gpus == ("0", "1", "2", "3")
    assert p.shared_gpus == ("0", "1") and p.save_gpu == "0"
    uuids = plan(shape(1, 1), shape(2, 1), ["GPU-a", "GPU-b"], 0.4)
    assert uuids.refusals == () and uuids.new_gpus == ("GPU-a", "GPU-b") and uuids.save_gpu == "GPU-a"


def test_too_few_gpus_is_refused_with_the_reason() -> None:
    p = plan(shape(1, 2), shape(1, 4), ["0", "1"], 0.35)
    assert p.refusals == ("the new shape ep4-dp4 needs 4 GPUs, this machine has 2 (0, 1)",)
    none = plan(shape(1, 2), shape(1, 4), [], 0.35)
    assert any("has 0 (none visible)" in r for r in none.refusals) and len(none.refusals) == 2


def test_memory_fractions_that_cannot_share_a_gpu_and_no_switch_are_refused() -> None:
    half = plan(shape(1, 2), shape(1, 4), list("0123"), 0.5)
    assert any("do not fit on one GPU" in r for r in half.refusals)
    assert plan(shape(1, 2), shape(1, 4), list("0123"), 0.45).refusals == ()
    assert any("nothing switches" in r for r in plan(shape(1, 2), shape(1, 2), list("01"), 0.35).refusals)


def test_visible_gpus() -> None:
    assert visible_gpus("2,3", 8) == ["2", "3"]
    assert visible_gpus(None, 4) == ["0", "1", "2", "3"]
    assert visible_gpus("", 4) == [] and visible_gpus(None, 0) == []


def _reqs() -> list[dict[str, Any]]:
    ok = [{"i": i, "sent": 100.0 + i, "done": 100.0 + i + 0.1 * (i + 1), "ok": True} for i in range(10)]
    return [*ok, {"i": 10, "sent": 105.5, "done": 106.0, "ok": False, "error": "TimeoutError: "}]


def test_windows_count_requests_sent_in_them() -> None:
    w = window(_reqs(), 100.0, 105.0)
    assert (w["sent"], w["served"], w["failed"]) == (5, 5, 0) and w["seconds"] == 5.0
    assert w["latency_p50_s"] == 0.3 and w["latency_p99_s"] == 0.5 and w["latency_max_s"] == 0.5
    late = window(_reqs(), 105.0, None)
    assert (late["sent"], late["served"], late["failed"]) == (6, 5, 1)
    assert late["errors"] == ["TimeoutError: "]
    assert window([], 0.0, 1.0)["latency_p50_s"] is None


def test_tokens_are_compared_per_dp_rank() -> None:
    native = {"1": {"dp0": [[1, 2]], "dp1": [[3, 4]]}, "4": {"dp0": [[5]] * 4, "dp1": [[6]] * 4}}
    same = rep.compare_tokens(json.loads(json.dumps(native)), native)
    assert same["identical"] is True and same["dp_ranks"] == {"dp0": True, "dp1": True}
    wrong = json.loads(json.dumps(native))
    wrong["4"]["dp1"][2] = [7]
    diff = rep.compare_tokens(wrong, native)
    assert diff["identical"] is False and diff["dp_ranks"] == {"dp0": True, "dp1": False}
    assert diff["cases"]["B=4 dp1"] is False and diff["cases"]["B=1 dp1"] is True
    assert rep.compare_tokens({"1": [[1]]}, {"1": [[1]]})["identical"] is True
    assert rep.compare_tokens(None, native)["identical"] is None


def _rank(how: str, at_start: int | None, serving: int | None, splice: float = 3.0) -> dict[str, Any]:
    stages: dict[str, Any] = {"capture": {"how": how, "seconds": 0.5},
                              "load": {"graphs": 10, "timings": {"splice_now_ms": splice, "verify_ms": 7.5}}}
    if at_start is not None:
        stages["cudagraphs"] = {"at_start": at_start, "serving": serving}
    return {"stages": stages, "world": 2}


def _results(restored_ranks: list[dict[str, Any]], old_first: float | None = 2.0) -> dict[str, Any]:
    toks = {"1": {"dp0": [[1]], "dp1": [[2]]}}
    ranks = {str(i): {**r, "rank": i} for i, r in enumerate(restored_ranks)}
    native_ranks = {str(i): {**_rank("native", 51, 0), "rank": i} for i in range(2)}
    reqs = [{"i": i, "sent": 10.0 + i, "done": 10.2 + i, "ok": True} for i in range(30)]
    old = {"rc": 0, "first_token_s": old_first, "first_token_mono": 10.0 if old_first else None,
           "requests": reqs, "ember": {"ranks": native_ranks}}
    return {
        "saves": {"old": {"published": True, "save_job_s": 80.0},
                  "new": {"published": True, "save_job_s": 90.0}},
        "old": old,
        "switches": {
            "restored": {"rc": 0, "switch_mono": 15.0, "first_token_mono": 22.0, "exit_mono": 25.0,
                         "switch_to_first_token_s": 7.0, "engine_init_s": 3.0, "tokens": toks,
                         "ember": {"ranks": ranks}},
            "native": {"rc": 0, "switch_mono": 30.0, "first_token_mono": 38.0, "exit_mono": 39.5,
                       "switch_to_first_token_s": 40.0, "engine_init_s": 30.0, "tokens": toks,
                       "ember": {"ranks": native_ranks}},
        },
    }


def test_goals_met_when_every_rank_restores_without_capturing() -> None:
    p = plan(shape(1, 2), shape(1, 4), list("0123"), 0.35)
    s = rep.summarize(p, vs.Options(), _results([_rank("restored", 0, 0), _rank("restored", 0, 0)]))
    verdicts = {g["key"]: g["verdict"] for g in s["goals"]}
    assert verdicts.pop("sooner_warm") == rep.NOT_MEASURED  # no native-warm start here
    assert set(verdicts.values()) == {rep.MET}, verdicts
    assert s["switches"]["restored"]["ranks"]["1"]["graphs_captured_at_start"] == 0
    assert s["switches"]["restored"]["ranks"]["1"]["verify_ms"] == 7.5
    assert s["service"]["before"]["sent"] == 5 and s["service"]["restored"]["to_first_token"]["served"] == 7
    assert s["tokens"]["identical"] is True


def test_goals_not_met_and_not_measured() -> None:
    p = plan(shape(1, 2), shape(1, 4), list("0123"), 0.35)
    mixed = [_rank("restored", 0, 0), _rank("native", 51, 2, 40.0)]
    captured = rep.summarize(p, vs.Options(), _results(mixed))
    by = {g["key"]: g for g in captured["goals"]}
    assert by["restored"]["verdict"] == rep.NOT_MET and by["tokens"]["verdict"] == rep.MET
    assert by["graphs"]["verdict"] == rep.NOT_MET and by["graphs"]["value"] == 53
    assert by["splice"]["verdict"] == rep.NOT_MET and by["splice"]["value"] == 40.0
    unknown = rep.summarize(p, vs.Options(), _results([_rank("restored", None, None)] * 2, old_first=None))
    by = {g["key"]: g for g in unknown["goals"]}
    assert by["graphs"]["verdict"] == rep.NOT_MEASURED and by["restored"]["verdict"] == rep.MET
    assert by["old_serves"]["verdict"] == rep.NOT_MET
    assert by["old_serves"]["value"] == "the old shape never served"


def test_the_command_refuses_two_gpus_for_ep4_and_says_so(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_bench.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    res = CliRunner().invoke(app, ["vllm-switch", "--out-dir", str(tmp_path), "--work", str(tmp_path / "w")])
    assert res.exit_code == 2, res.output
    (md,) = tmp_path.glob("vllm-switch-*-qwen3-moe-4l-ep2-dp2-to-ep4-dp4.md")
    assert "NOT RUN" in md.read_text() and "needs 4 GPUs, this machine has 2" in md.read_text()
    (js,) = tmp_path.glob("vllm-switch-*.json")
    assert json.loads(js.read_text())["summary"]["status"] == "refused"
    assert not (tmp_path / "w").exists()  # nothing started


def test_variants_native_warm_after_native() -> None:
    from ember_bench.vllm_switch_plan import variants_problem

    assert variants_problem(vs.VARIANTS, vs.VARIANTS) == ""
    assert variants_problem(("native", "restored"), vs.VARIANTS) == ""
    assert "native before it" in variants_problem(("native-warm", "native"), vs.VARIANTS)
    assert "native before it" in variants_problem(("restored", "native-warm"), vs.VARIANTS)
    assert "at most once" in variants_problem(("restored", "restored"), vs.VARIANTS)
    assert "at most once" in variants_problem(("warm",), vs.VARIANTS) and variants_problem((), vs.VARIANTS)
