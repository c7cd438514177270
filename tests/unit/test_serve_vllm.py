"""`ember serve --engine vllm`: the hand-off decides how `vllm serve` starts (LOAD of the
sidecar's archive under libember, or native), the crash marker covers vLLM's start until its
/health answers, `ready` reaches the sidecar, and a vLLM that dies while loading makes the next
start capture natively. A stand-in `vllm` executable records what it was given."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember import handoff, native

ROOT = Path(__file__).resolve().parents[2]
FAKE = r'''#!/usr/bin/env python3
import http.server, json, os, signal, sys
keep = ("LD_PRELOAD", "EMBER_MODE", "EMBER_VLLM_ARCHIVE", "EMBER_VLLM_REPORT", "VLLM_USE_FLASHINFER_SAMPLER")
with open(os.environ["FAKE_VLLM_OUT"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep},
                        "stale_report": os.path.exists(os.environ.get("EMBER_VLLM_REPORT") or "/none")})
            + "\n")
if os.environ.get("FAKE_VLLM_CRASH"):
    sys.exit(7)
if os.environ.get("EMBER_VLLM_REPORT"):  # what ember's plugin writes while vLLM starts
    with open(os.environ["EMBER_VLLM_REPORT"], "w") as f:
        json.dump({"stages": {"capture": {"how": "fake-vllm"}}}, f)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    if native.find_library() is None:
        pytest.skip("libember not built")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "vllm"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_VLLM_OUT=str(tmp_path / "calls.jsonl"),
               PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}")
    return env


def _serve(env: dict[str, str], run_dir: Path, port: int) -> subprocess.Popen[str]:
    # --engine comes from EMBER_ENGINE, as the operator's pod sets it
    cmd = [sys.executable, "-c", "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()",
           "serve", "--run-dir", str(run_dir), "--deadline", "5", "--", "--model", "m", "--port", str(port)]
    return subprocess.Popen(cmd, env={**env, "EMBER_ENGINE": "vllm"}, text=True, stderr=subprocess.PIPE)


def _wait_ready(w: handoff.HandoffWriter, timeout: float = 20) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for r in w.new_reports():
            if r["stage"] == "ready":
                return r
        time.sleep(0.05)
    raise AssertionError("no ready report")


def _calls(env: dict[str, str]) -> list[dict]:
    return [json.loads(x) for x in Path(env["FAKE_VLLM_OUT"]).read_text().splitlines()]


def test_handed_off_archive_starts_vllm_under_libember_and_clears_the_marker(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    w = handoff.HandoffWriter(tmp_path / "run")
    d = w.archive_dir("abc")
    d.mkdir(parents=True)
    (d / "manifest").write_text("{}")
    w.ready("abc", d, engine_args=("--max-model-len", "4096"))
    stale = '{"stages": {"capture": {"how": "restored"}}}'
    (w.run_dir / "vllm-report.json").write_text(stale)  # a previous start's
    port = _port()
    proc = _serve(fake_vllm, w.run_dir, port)
    try:
        ready = _wait_ready(w)
        assert ready["restored"] is True and ready["engine"] == "vllm"
        assert ready["vllm"]["stages"]["capture"]["how"] == "fake-vllm"  # this start's, not the stale one
        assert not (w.run_dir / handoff.MARKER_FILE).exists()
        (call,) = _calls(fake_vllm)
        # the command line's arguments, then the claim's (the deployment's engine.args)
        assert call["argv"] == ["serve", "--model", "m", "--port", str(port), "--max-model-len", "4096"]
        assert call["env"]["EMBER_MODE"] == "load" and call["env"]["EMBER_VLLM_ARCHIVE"] == str(d)
        assert "libember" in call["env"]["LD_PRELOAD"] and "libember_nccl" not in call["env"]["LD_PRELOAD"]
        assert call["env"]["EMBER_VLLM_REPORT"] == str(w.run_dir / "vllm-report.json")
        assert call["stale_report"] is False  # vLLM's processes add to the report: it starts empty
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""


def test_vllm_dying_while_loading_leaves_the_marker_and_the_next_start_is_native(
    tmp_path: Path, fake_vllm
) -> None:
    w = handoff.HandoffWriter(tmp_path / "run")
    d = w.archive_dir("abc")
    d.mkdir(parents=True)
    (d / "manifest").write_text("{}")
    w.ready("abc", d)
    crash = {**fake_vllm, "FAKE_VLLM_CRASH": "1"}
    proc = _serve(crash, w.run_dir, _port())
    assert proc.wait(timeout=20) == 7  # vLLM's exit code passes through
    assert (w.run_dir / handoff.MARKER_FILE).exists()
    port = _port()
    proc = _serve(fake_vllm, w.run_dir, port)
    try:
        ready = _wait_ready(w)
        assert ready["restored"] is False
        second = _calls(fake_vllm)[-1]
        assert second["env"]["EMBER_MODE"] is None and second["env"]["EMBER_VLLM_ARCHIVE"] is None
        assert not second["env"]["LD_PRELOAD"]
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
