"""`ember serve --engine vllm` on an identity-keyed warm pod (the archive handed off before any
claim): vLLM starts, one real token goes through its OpenAI API, only then is the engine `ready`
(claimable); `ready` reaches the sidecar only after the claim; with EMBER_WARM_ENGINE=sleeping vLLM
sleeps (POST /sleep?level=1) before `ready` and is woken (POST /wake_up) by the claim; a vLLM that
dies or fails on the way leaves the engine `failed` with the reason and its exit code. Against the
stand-in `vllm` of tests/support/fake_vllm.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from support.fake_vllm import (
    archive,
    calls,
    engine_state,
    fake_vllm_env,
    free_port,
    http_calls,
    quit_vllm,
    serve,
    wait_engine,
    wait_report,
)
from support.sidecar import wait_for

from ember import contract, handoff
from ember.serving.vllm import SLEEP_MODE_ARG, serve_args


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    return fake_vllm_env(tmp_path)


def _warm(tmp_path: Path, *engine_args: str) -> handoff.HandoffWriter:
    """The sidecar of a warm pod: the archive handed off, no claim yet."""
    w = handoff.HandoffWriter(tmp_path / "run")
    w.warm = True
    w.ready("abc", archive(w), engine_args=engine_args)
    return w


def _paths(env: dict[str, str]) -> list[str]:
    return [c["call"] for c in http_calls(env)]


def test_warm_pod_is_ready_only_after_a_token_and_in_service_only_after_the_claim(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path, "--api-key", "sekret")  # the deployment's API key: ember's calls carry it
    proc = serve({**fake_vllm, "FAKE_VLLM_TOKEN_DELAY": "1.0"}, w.run_dir, free_port())
    seen: list[dict] = []
    try:
        # vLLM healthy, the token on its way: loading, the crash marker still there
        wait_for(lambda: "POST /v1/completions" in _paths(fake_vllm), 20, "the warm-up token")
        assert engine_state(w.run_dir)["state"] == contract.ENGINE_LOADING
        assert (w.run_dir / handoff.MARKER_FILE).exists(), "not proven before its first token"
        ready = wait_engine(w.run_dir, contract.ENGINE_READY)
        token = next(c for c in http_calls(fake_vllm) if c["call"] == "POST /v1/completions")
        assert ready["at"] > token["t"] + 0.9, "ready only after the token came back"
        assert ready["mode"] == "ready" and ready["restored"] is True and ready["identity"] == "abc"
        assert token["body"] == {"model": "m", "prompt": list(range(11, 27)), "max_tokens": 1,
                                 "temperature": 0}
        assert {c["auth"] for c in http_calls(fake_vllm)} == {"Bearer sekret"}
        assert not (w.run_dir / handoff.MARKER_FILE).exists()
        assert wait_report(w, "load", seen)["result"] == "ok"
        time.sleep(1.0)  # idle, warm: no `ready` for the sidecar before the claim
        seen.extend(w.new_reports())
        assert not [r for r in seen if r["stage"] == "ready"]
        assert proc.poll() is None
        claimed_at = time.time()
        w.in_service(claimed_at)
        report = wait_report(w, "ready", seen)
        assert report["at"] >= claimed_at and 0 <= report["seconds"] < 2.0  # claim → ready
        assert report["warm_engine"] == "ready" and report["restored"] is True
        stages = report["stages"]
        assert stages["warm_up_token_s"] >= 0.9 and stages["warm_wait_s"] >= 1.0
        assert stages["engine_ready_s"] >= stages["healthy_s"] + stages["warm_up_token_s"] - 0.01
        assert "sleep_s" not in stages and "wake_up_s" not in stages
        assert not [p for p in _paths(fake_vllm) if "/sleep" in p or "/wake_up" in p]
        (started,) = [c for c in calls(fake_vllm) if "argv" in c]
        assert SLEEP_MODE_ARG not in started["argv"] and started["env"]["VLLM_SERVER_DEV_MODE"] is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
    assert engine_state(w.run_dir)["state"] == contract.ENGINE_READY


def test_sleeping_warm_pod_sleeps_before_ready_and_wakes_at_the_claim(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path, SLEEP_MODE_ARG)  # the operator puts the flag into the claim's arguments
    proc = serve(fake_vllm, w.run_dir, free_port(), EMBER_WARM_ENGINE="sleeping")
    seen: list[dict] = []
    try:
        ready = wait_engine(w.run_dir, contract.ENGINE_READY)
        assert ready["mode"] == "sleeping"
        assert _paths(fake_vllm) == ["GET /v1/models", "POST /v1/completions", "POST /sleep?level=1"]
        asleep = http_calls(fake_vllm)[-1]
        assert asleep["t"] < ready["at"], "asleep before the operator may claim it"
        (started,) = [c for c in calls(fake_vllm) if "argv" in c]
        assert started["argv"].count(SLEEP_MODE_ARG) == 1 and started["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        time.sleep(0.5)
        assert _paths(fake_vllm)[-1] == "POST /sleep?level=1", "asleep until the claim"
        claimed_at = time.time()
        w.in_service(claimed_at)
        report = wait_report(w, "ready", seen)
        assert _paths(fake_vllm)[-1] == "POST /wake_up"
        woken = http_calls(fake_vllm)[-1]
        assert claimed_at <= woken["t"] <= report["at"] and woken["sleeping"] is True
        assert report["warm_engine"] == "sleeping" and {"sleep_s", "wake_up_s"} <= set(report["stages"])
        assert report["seconds"] >= report["stages"]["wake_up_s"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_sleeping_adds_the_sleep_mode_flag_once() -> None:
    result = handoff.HandoffResult(None, engine_args=("--max-model-len", "4096"), warm=True)
    assert serve_args(["--port", "1"], result, sleeping=True) == [
        "--port", "1", "--max-model-len", "4096", SLEEP_MODE_ARG]
    assert serve_args([SLEEP_MODE_ARG], result, sleeping=True).count(SLEEP_MODE_ARG) == 1
    assert SLEEP_MODE_ARG not in serve_args([], result, sleeping=False)


def test_vllm_dying_while_warm_fails_the_engine_and_passes_its_exit_code(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path)
    port = free_port()
    proc = serve(fake_vllm, w.run_dir, port)
    wait_engine(w.run_dir, contract.ENGINE_READY)
    quit_vllm(port, 3)
    assert proc.wait(timeout=20) == 3
    state = engine_state(w.run_dir)
    assert state["state"] == contract.ENGINE_FAILED and "exited 3 while warm" in state["reason"]
    annotation = contract.engine_annotation(state["state"], state["reason"])
    assert annotation.startswith("failed: vllm serve exited 3")


def test_vllm_dying_before_healthy_fails_the_engine_and_keeps_the_marker(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path)
    proc = serve({**fake_vllm, "FAKE_VLLM_CRASH": "1"}, w.run_dir, free_port())
    assert proc.wait(timeout=20) == 7
    state = engine_state(w.run_dir)
    assert state["state"] == contract.ENGINE_FAILED and "exited 7 before it was healthy" in state["reason"]
    assert (w.run_dir / handoff.MARKER_FILE).exists(), "the next start captures natively"


def test_a_failing_warm_up_token_fails_the_engine_stops_vllm_and_keeps_the_marker(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path)
    proc = serve({**fake_vllm, "FAKE_VLLM_TOKEN_STATUS": "500"}, w.run_dir, free_port())
    assert proc.wait(timeout=20) == 1
    state = engine_state(w.run_dir)
    assert state["state"] == contract.ENGINE_FAILED and "warm-up token" in state["reason"]
    assert "HTTP 500" in state["reason"]
    assert (w.run_dir / handoff.MARKER_FILE).exists(), "restored graphs that cannot serve: next start native"


def test_a_signal_while_warm_stops_vllm_without_failing_the_engine(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = _warm(tmp_path)
    proc = serve(fake_vllm, w.run_dir, free_port())
    wait_engine(w.run_dir, contract.ENGINE_READY)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert engine_state(w.run_dir)["state"] == contract.ENGINE_READY
