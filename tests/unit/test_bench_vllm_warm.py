"""`ember bench vllm-warm` on CPU: the deployments are the operator's (sleeping: its own archive,
vLLM's sleep mode in the SAVE and the claim), the report's figures and goal verdicts, and one pod
of each kind driven end to end against the stand-in `vllm` (tests/support/fake_vllm.py): the
figures a GPU run reports are measured and nothing fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.fake_vllm import fake_vllm_env, http_calls

from ember_bench.vllm_warm import Deployment, Options, deployment, run_pod
from ember_bench.vllm_warm_report import markdown, parse_smi, summarize


def _deps(tmp_path: Path) -> dict[str, Deployment]:
    cfg = tmp_path / "config"
    return {m: deployment(cfg, m, Options(work=tmp_path), "0.26.0") for m in ("ready", "sleeping")}


def test_the_deployments_are_the_operators(tmp_path: Path) -> None:
    deps = _deps(tmp_path)
    ready, sleeping = deps["ready"], deps["sleeping"]
    assert ready.identity.hash() != sleeping.identity.hash(), "sleep mode allocates differently"
    assert "--enable-sleep-mode" not in ready.save_args and sleeping.save_args[-1] == "--enable-sleep-mode"
    assert sleeping.claim_args[-1] == "--enable-sleep-mode"
    assert ready.claim_args[:2] == ("--model", str(tmp_path / "config"))  # the identity's arguments first
    assert "--skip-tokenizer-init" in ready.save_args and ready.identity.engine == "vllm"


def test_nvidia_smi_lines_parse() -> None:
    assert parse_smi("81234\n") == [81234]
    assert parse_smi("512, 81559\nNo devices were found\n") == [512]


def _result(run: str, first: float | None, idle: list[int] | None, restored: bool = True,
            tokens: Any = (1, 2)) -> dict[str, Any]:
    return {"run": run, "claim_to_first_token_s": first, "gpu_before_mib": 500, "gpu_idle_mib": idle,
            "gpu_serving_mib": [70_500], "tokens": list(tokens),
            "ready_report": {"restored": restored, "stages": {"claim_to_ready_s": 0.01}}}


def test_report_figures_and_goals() -> None:
    results = {"cold-native": _result("cold-native", 95.0, None, restored=False),
               "cold-restored": _result("cold-restored", 30.0, None),
               "warm-ready": _result("warm-ready", 0.12, [70_500, 70_600, 70_500]),
               "warm-sleeping": _result("warm-sleeping", 0.8, [3_500, 3_500, 3_600])}
    summary = summarize(results, {"ready": {"identity": "a", "published": True}}, {"name": "NVIDIA H100"})
    runs, goals = summary["runs"], summary["goals"]
    assert runs["warm-ready"]["gpu_idle_held_mib"] == 70_000
    assert runs["warm-sleeping"]["gpu_idle_held_mib"] == 3_000
    assert runs["warm-sleeping"]["tokens_equal_native"] is True
    assert runs["cold-native"]["tokens_equal_native"] is None
    assert all(goals.values()), goals
    md = markdown("llama-3-8b", summary)
    assert "| claim → first token (client) | 95.000 s | 30.000 s | 0.120 s | 0.800 s |" in md
    # too slow, or fast only because it captured natively, or tokens that differ: not met
    results["warm-ready"]["claim_to_first_token_s"] = 0.45
    results["warm-sleeping"] = _result("warm-sleeping", 0.5, [3_500], restored=False, tokens=(9, 9))
    goals = summarize(results, {}, {})["goals"]
    assert [goals[g] for g in goals if g.startswith("warm")] == [False, False, True]
    assert goals["tokens after the wake-up equal cold-native's"] is False
    assert all(v is None for k, v in summarize({}, {}, {})["goals"].items() if "error" not in k)


@pytest.mark.parametrize("run", ["cold-restored", "warm-sleeping"])
def test_one_pod_end_to_end_against_the_stand_in(
    run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = fake_vllm_env(tmp_path)
    for key in ("PATH", "PYTHONPATH", "FAKE_VLLM_OUT"):
        monkeypatch.setenv(key, env[key])
    deps = _deps(tmp_path)
    d = deps["sleeping" if run == "warm-sleeping" else "ready"]
    store = tmp_path / "store"
    (store / "archives" / d.identity.hash()).mkdir(parents=True)
    (store / "archives" / d.identity.hash() / "manifest").write_text("{}")
    res = run_pod(run, d, store, Options(work=tmp_path, idle_s=0.2, timeout=30), "0")
    assert "error" not in res, res.get("log_tail") or res
    assert res["exit_code"] == 0 and res["ready_report"]["restored"] is True
    assert 0 < res["claim_to_first_token_s"] < 10 and res["first_token_refusals"] == 0
    assert res["tokens"] is None and "no token ids" in res["tokens_error"]  # the stand-in returns text
    calls = [c["call"] for c in http_calls(env)]
    if run == "warm-sleeping":
        assert res["engine_state"]["mode"] == "sleeping"
        assert calls.index("POST /sleep?level=1") < calls.index("POST /wake_up")
        assert res["ready_report"]["warm_engine"] == "sleeping"
    else:
        assert not [c for c in calls if "sleep" in c or "wake" in c]
