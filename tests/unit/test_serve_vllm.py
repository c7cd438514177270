"""`ember serve --engine vllm`: the hand-off decides how `vllm serve` starts (LOAD of the
sidecar's archive under libember, or native), the crash marker covers vLLM's start until its
/health answers, `load` (how vLLM's LOAD went) and `ready` reach the sidecar, the engine state
goes loading → ready (or failed), and a vLLM that dies while loading makes the next start
capture natively. A stand-in `vllm` executable (tests/support/fake_vllm.py) records what it was
given. Warm pods: test_serve_vllm_warm.py."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from support.fake_vllm import archive, calls, engine_state, fake_vllm_env, free_port, serve, wait_report

from ember import handoff


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    return fake_vllm_env(tmp_path)


def test_handed_off_archive_starts_vllm_under_libember_and_clears_the_marker(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = handoff.HandoffWriter(tmp_path / "run")
    d = archive(w)
    w.ready("abc", d, engine_args=("--max-model-len", "4096"))
    stale = '{"stages": {"capture": {"how": "restored"}}}'
    (w.run_dir / "vllm-report.json").write_text(stale)  # a previous start's
    port = free_port()
    proc = serve(fake_vllm, w.run_dir, port)
    seen: list[dict] = []
    try:
        ready = wait_report(w, "ready", seen)
        assert ready["restored"] is True and ready["engine"] == "vllm"
        assert ready["vllm"]["stages"]["capture"]["by"] == "fake-vllm"  # this start's, not the stale one
        assert not (w.run_dir / handoff.MARKER_FILE).exists()
        # the sidecar hears that vLLM restored (it records the restore; no engine timeout later)
        (load,) = [r for r in seen if r["stage"] == "load"]
        assert load["result"] == "ok" and load["graphs"] == 3 and load["seconds"] == 0.25
        state = engine_state(w.run_dir)
        assert state["state"] == "ready" and state["identity"] == "abc" and state["restored"] is True
        (call,) = calls(fake_vllm)
        # the command line's arguments, then the claim's (the deployment's engine.args)
        assert call["argv"] == ["serve", "--model", "m", "--port", str(port), "--max-model-len", "4096"]
        assert call["env"]["EMBER_MODE"] == "load" and call["env"]["EMBER_VLLM_ARCHIVE"] == str(d)
        assert "libember" in call["env"]["LD_PRELOAD"] and "libember_nccl" not in call["env"]["LD_PRELOAD"]
        assert call["env"]["EMBER_VLLM_REPORT"] == str(w.run_dir / "vllm-report.json")
        assert call["env"]["VLLM_SERVER_DEV_MODE"] is None  # no sleep mode: no development endpoints
        assert call["stale_report"] is False  # vLLM's processes add to the report: it starts empty
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
    assert engine_state(w.run_dir)["state"] == "ready", "a signal is a shutdown, not an engine failure"


def test_vllm_dying_while_loading_leaves_the_marker_and_the_next_start_is_native(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = handoff.HandoffWriter(tmp_path / "run")
    w.ready("abc", archive(w))
    proc = serve({**fake_vllm, "FAKE_VLLM_CRASH": "1"}, w.run_dir, free_port())
    assert proc.wait(timeout=20) == 7  # vLLM's exit code passes through
    assert (w.run_dir / handoff.MARKER_FILE).exists()
    state = engine_state(w.run_dir)
    assert state["state"] == "failed" and "exited 7 before it was healthy" in state["reason"]
    proc = serve(fake_vllm, w.run_dir, free_port())
    seen: list[dict] = []
    try:
        ready = wait_report(w, "ready", seen)
        assert ready["restored"] is False
        loads = [r for r in seen if r["stage"] == "load"]
        assert loads and all(r["result"] == "fallback" and r["reason"].startswith(handoff.REASON_CRASHED)
                             for r in loads)
        second = calls(fake_vllm)[-1]
        assert second["env"]["EMBER_MODE"] is None and second["env"]["EMBER_VLLM_ARCHIVE"] is None
        assert not second["env"]["LD_PRELOAD"]
        assert engine_state(w.run_dir)["state"] == "ready"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_a_world_whose_ranks_did_not_all_restore_is_a_fallback_with_the_ranks_reason(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = handoff.HandoffWriter(tmp_path / "run")
    w.ready("abc", archive(w))
    stale = w.run_dir / "vllm-report.rank3.json"
    stale.write_text('{"rank": 3, "world": 4}')  # a previous start's rank file
    env = {**fake_vllm, "FAKE_VLLM_RANKS": "restored,native-after-refusal"}
    proc = serve(env, w.run_dir, free_port())
    seen: list[dict] = []
    try:
        ready = wait_report(w, "ready", seen)
        assert ready["restored"] is False and set(ready["vllm"]["ranks"]) == {"0", "1"}
        (load,) = [r for r in seen if r["stage"] == "load"]
        assert load["result"] == "fallback"
        assert load["reason"] == "rank 1: divergence: fake rank (restored on 1 of 2 ranks)"
        assert not stale.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    env["FAKE_VLLM_RANKS"] = "restored,restored"
    proc = serve(env, w.run_dir, free_port())
    seen = []
    try:
        ready = wait_report(w, "ready", seen)
        assert ready["restored"] is True
        (load,) = [r for r in seen if r["stage"] == "load"]
        assert load["result"] == "ok" and load["ranks"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.mark.parametrize(("shape", "replicas", "parallel"), [
    (["--data-parallel-size", "2"], "2", False),  # a dense model's replicas: the one-GPU archive's settings
    (["--tensor-parallel-size", "2"], None, True),
    (["-tp", "2", "-dp", "2"], "2", True),
])
def test_vllm_runs_with_the_settings_of_the_archive_its_shape_restores(
    shape: list[str], replicas: str | None, parallel: bool, tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    """Every VLLM_* variable is in vLLM's compile-cache hash: a pod runs with what its archive's
    SAVE ran with (the parallel settings only for a parallel archive), and each dense DP replica's
    workers learn the pod's replica count to report as ranks of the pod."""
    w = handoff.HandoffWriter(tmp_path / "run")
    w.ready("abc", archive(w), engine_args=tuple(shape))
    proc = serve(fake_vllm, w.run_dir, free_port())
    try:
        wait_report(w, "ready", [])
        (call,) = calls(fake_vllm)
        assert call["env"]["EMBER_VLLM_REPLICAS"] == replicas
        assert call["env"]["VLLM_ALLREDUCE_USE_SYMM_MEM"] == ("0" if parallel else None)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_without_the_console_script_vllm_runs_as_a_module_of_this_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ember.serving.vllm import _vllm_command

    monkeypatch.setenv("PATH", str(tmp_path))  # no `vllm` here
    assert _vllm_command("vllm") == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert _vllm_command("vllm") == [str(exe)]
