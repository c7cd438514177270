"""`ember bench cb-warm` on CPU: the deployment is the operator's (engine transformers; the pods'
`ember serve` arguments, which the claim carries, are the ones `ember serve` accepts as its own:
no claim refused), the runs it refuses, and the report's figures and goal verdicts from results
made by hand. The pods themselves (`ember serve` needs torch, transformers and a GPU) are not run
here: there is no stand-in `ember serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer

from ember import contract
from ember.serving.options import serve_options
from ember.serving.server import claim_problem
from ember_bench.cb_warm import Options, check_runs, deployment
from ember_bench.cb_warm_report import markdown, summarize


def test_the_deployment_is_the_operators() -> None:
    d = deployment(Options(layers=4, serve_args=("--num-blocks", "128")), "5.17.0")
    assert d.identity.engine == "transformers" and d.identity.engine_version == "5.17.0"
    assert d.identity.model == "llama-3-8b" and d.mode == contract.WARM_ENGINE_READY
    assert d.save_args == ["--layers", "4", "--num-blocks", "128"]
    assert d.serve_args == ("--model", "llama-3-8b", "--layers", "4", "--num-blocks", "128")
    pod, unknown = serve_options(d.serve_args)
    assert not unknown and pod.model == "llama-3-8b" and pod.layers == 4 and pod.num_blocks == 128
    assert claim_problem(pod, d.serve_args) == "", "the warm pod must serve the claim it is handed"
    other = deployment(Options(layers=2), "5.17.0")
    assert other.identity.hash() != d.identity.hash() and claim_problem(pod, other.serve_args)


def test_a_model_config_names_the_model(tmp_path: Path) -> None:
    d = deployment(Options(model_config=tmp_path / "small.json"), "5.17.0")
    assert d.identity.model == "small" and "--model" not in d.serve_args
    assert d.serve_args[:2] == ("--model-config", str(tmp_path / "small.json"))
    assert Options(model_config=tmp_path / "small.json", layers=2).tag == "small-2l"


def test_sleeping_and_unknown_runs_are_refused() -> None:
    with pytest.raises(typer.BadParameter, match="no sleeping engine"):
        check_runs(("cold-native", "warm-sleeping"))
    with pytest.raises(typer.BadParameter, match="unknown runs"):
        check_runs(("warm-readyy",))
    check_runs(("warm-ready", "cold-restored"))


def _result(run: str, first: float, restored: bool, tokens: Any = (5, 6), idle: list[int] | None = None
            ) -> dict[str, Any]:
    return {"run": run, "claim_to_first_token_s": first, "gpu_before_mib": 600, "gpu_idle_mib": idle,
            "gpu_serving_mib": [17_600], "tokens": list(tokens), "restored": restored,
            "claim_to_ready_s": first / 2, "stages": {"first_token": first / 2},
            "ready_report": {"stage": "ready", "seconds": first / 2,
                             "mode": "restored" if restored else "native"}}


def test_report_figures_and_goals() -> None:
    results = {"cold-native": _result("cold-native", 60.0, False),
               "cold-restored": _result("cold-restored", 15.0, True),
               "warm-ready": _result("warm-ready", 0.08, True, idle=[17_500, 17_700, 17_600])}
    summary = summarize(results, {"ready": {"identity": "a", "published": True}}, {"name": "NVIDIA H200"})
    runs, goals = summary["runs"], summary["goals"]
    assert runs["warm-ready"]["gpu_idle_held_mib"] == 17_000
    assert runs["warm-ready"]["restored"] is True and runs["cold-native"]["restored"] is False
    assert runs["cold-restored"]["claim_to_ready_s"] == 7.5
    assert runs["warm-ready"]["tokens_equal_reference"] is True
    assert summary["tokens_reference"] == "cold-native"
    assert summary["cold_restored_over_native"] == 0.25
    assert all(goals.values()), goals
    md = markdown("llama-3-8b", summary)
    assert "| claim → first token (client) | 60.000 s | 15.000 s | 0.080 s |" in md and "0.250" in md
    # too slow, restored tokens that differ, a cold restored start no faster than native: not met
    results["warm-ready"]["claim_to_first_token_s"] = 0.31
    results["cold-restored"] = _result("cold-restored", 61.0, True, tokens=(5, 7))
    goals = summarize(results, {}, {})["goals"]
    assert [v for g, v in goals.items() if "error" not in g] == [False, False, False]
    # fast because it captured natively: the warm goal is not met
    results["warm-ready"] = _result("warm-ready", 0.05, False)
    assert next(iter(summarize(results, {}, {})["goals"].values())) is False
    results["warm-ready"]["error"] = "RuntimeError: engine failed"
    assert summarize(results, {}, {})["goals"]["every run without an error"] is False
    assert all(v is None for k, v in summarize({}, {}, {})["goals"].items() if "error" not in k)
