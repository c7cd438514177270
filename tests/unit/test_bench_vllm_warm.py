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
               "cold-native-warm-cache": _result("cold-native-warm-cache", 40.0, None, restored=False),
               "cold-restored": _result("cold-restored", 19.0, None),
               "warm-ready": _result("warm-ready", 0.12, [70_500, 70_600, 70_500]),
               "warm-sleeping": _result("warm-sleeping", 0.8, [3_500, 3_500, 3_600])}
    summary = summarize(results, {"ready": {"identity": "a", "published": True}}, {"name": "NVIDIA H100"})
    runs, goals = summary["runs"], summary["goals"]
    assert runs["warm-ready"]["gpu_idle_held_mib"] == 70_000
    assert runs["warm-sleeping"]["gpu_idle_held_mib"] == 3_000
    assert runs["warm-sleeping"]["tokens_equal_reference"] is True
    assert runs["cold-native"]["tokens_equal_reference"] is None
    assert summary["tokens_reference"] == "cold-native"
    assert all(goals.values()), goals
    md = markdown("llama-3-8b", summary)
    assert "| claim → first token (client) | 95.000 s | 40.000 s | 19.000 s | 0.120 s | 0.800 s |" in md
    # too slow, or fast only because it captured natively, or tokens that differ: not met
    results["warm-ready"]["claim_to_first_token_s"] = 0.45
    results["warm-sleeping"] = _result("warm-sleeping", 0.5, [3_500], restored=False, tokens=(9, 9))
    goals = summarize(results, {}, {})["goals"]
    assert [goals[g] for g in goals if g.startswith("warm")] == [False, False, True]
    assert goals["tokens after the wake-up equal the reference run's"] is False
    # restored cold must take at most half of vLLM's own warm-cache start
    results["cold-restored"]["claim_to_first_token_s"] = 21.0
    assert summarize(results, {}, {})["goals"][next(g for g in goals if g.startswith("cold"))] is False
    # without a native run the restored cold start is the reference
    del results["cold-native"]
    assert summarize(results, {}, {})["tokens_reference"] == "cold-restored"
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


def test_runs_split_over_commands_go_on_from_the_earlier_report(tmp_path: Path) -> None:
    """A GPU command has a time limit: `--runs` of one command, then the others; the second keeps
    the first's runs of the same deployments and its SAVEs whose archives are still in the store."""
    from ember_bench.vllm_warm import go_on_from
    from ember_bench.vllm_warm_report import write_report

    deps = _deps(tmp_path)
    ready, sleeping = deps["ready"].identity.hash(), deps["sleeping"].identity.hash()
    gpu, out = {"name": "NVIDIA H100"}, tmp_path / "out"
    first = {"warm-ready": {"run": "warm-ready", "mode": "ready", "identity": ready},
             "cold-native": {"run": "cold-native", "mode": "ready", "identity": "another deployment"}}
    saves = {"ready": {"identity": ready, "published": True}, "sleeping": {"identity": sleeping}}
    write_report("llama-3-8b", first, saves, gpu, out)
    (tmp_path / "store" / "archives" / ready).mkdir(parents=True)
    (tmp_path / "store" / "archives" / ready / "manifest").write_text("{}")
    o = Options(work=tmp_path, out_dir=out, runs=("warm-sleeping",))
    results, kept = go_on_from(o, gpu, deps)
    assert list(results) == ["warm-ready"] and list(kept) == ["ready"]  # no archive of sleeping's
    again = Options(work=tmp_path, out_dir=out, runs=("warm-ready",))
    assert go_on_from(again, gpu, deps)[0] == {}, "a run given again is measured again"


def test_the_warm_cache_run_starts_from_cold_natives_cache(tmp_path: Path) -> None:
    """vLLM's own answer to a slow start is its compile cache on a node that ran the model: the
    run reuses what cold-native left, and refuses to measure a cold start under that name."""
    d = _deps(tmp_path)["ready"]
    res = run_pod("cold-native-warm-cache", d, tmp_path / "store", Options(work=tmp_path), "0")
    assert "run cold-native first" in res["error"]


def test_a_pods_gpu_memory_is_its_own_processes(tmp_path: Path) -> None:
    """Beside other GPU users the GPU's rise says nothing of the pod: the figure is the per-process
    use of the pod's process tree (vLLM's engine core is the API server's child)."""
    from ember_bench.pods import parse_apps, process_tree
    from ember_bench.vllm_warm_report import verdicts

    assert parse_apps("4242, 30000\n4243, 512\nNo running processes found\n") == {4242: 30000, 4243: 512}
    procs = ((10, 1, "ember"), (11, 10, "VLLM::EngineCore (x) y"), (12, 11, "w"), (20, 1, "other"))
    for pid, ppid, name in procs:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {ppid} 1 1 0\n")
    assert process_tree(10, tmp_path) == {10, 11, 12}
    assert process_tree(20, tmp_path) == {20}
    # the verdict prefers the pods' own figures: the GPU's rise (other lanes) would say the opposite
    rows = {"warm-ready": {"gpu_idle_pod_mib": 34_000, "gpu_idle_held_mib": 1_000},
            "warm-sleeping": {"gpu_idle_pod_mib": 11_000, "gpu_idle_held_mib": 9_000}}
    assert verdicts(rows)["warm sleeping holds less GPU memory idle than warm ready"] is True
