"""A stand-in `vllm` executable for the CPU tests of `ember serve --engine vllm`: `vllm serve`'s
HTTP surface that ember uses (/health, /v1/models, /v1/completions, and in development mode /sleep
and /wake_up), plus /quit?code=N to die with an exit code. It records its command line, its
environment and every call but /health (with the time, whether it was asleep, the Authorization
header) in FAKE_VLLM_OUT, one JSON object a line. Knobs (environment): FAKE_VLLM_CRASH (exit 7
at once), FAKE_VLLM_TOKEN_DELAY (seconds before a completion answers), FAKE_VLLM_TOKEN_STATUS
(its HTTP status), FAKE_VLLM_RANKS (e.g. "restored,native-after-refusal": one report file per
rank, as the GPU workers of a parallel world write them). With EMBER_VLLM_REPORT set it writes
what ember's plugin would: restored when EMBER_VLLM_ARCHIVE is set, native otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ember import handoff, native
from support.sidecar import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE = r'''#!/usr/bin/env python3
import http.server, json, os, signal, sys, threading, time
from urllib.parse import parse_qs, urlparse
keep = ("LD_PRELOAD", "EMBER_MODE", "EMBER_VLLM_ARCHIVE", "EMBER_VLLM_REPORT", "VLLM_USE_FLASHINFER_SAMPLER",
        "VLLM_SERVER_DEV_MODE", "EMBER_VLLM_REPLICAS", "VLLM_ALLREDUCE_USE_SYMM_MEM")
lock = threading.Lock()
def record(**entry):
    with lock, open(os.environ["FAKE_VLLM_OUT"], "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **entry}) + "\n")
record(argv=sys.argv[1:], env={k: os.environ.get(k) for k in keep},
       stale_report=os.path.exists(os.environ.get("EMBER_VLLM_REPORT") or "/none"))
if os.environ.get("FAKE_VLLM_CRASH"):
    sys.exit(7)
archive = os.environ.get("EMBER_VLLM_ARCHIVE")
def stages_of(how):
    stages = {"capture": {"how": how, "by": "fake-vllm"}}
    if how == "restored":
        stages["load"] = {"seconds": 0.25, "graphs": 3}
    elif how == "native-after-refusal":
        stages["load_refused"] = {"at": "load", "reason": "divergence: fake rank"}
    return stages
if os.environ.get("EMBER_VLLM_REPORT"):  # what ember's plugin writes while vLLM starts
    path = os.environ["EMBER_VLLM_REPORT"]
    ranks = [r for r in os.environ.get("FAKE_VLLM_RANKS", "").split(",") if r]
    with open(path, "w") as f:  # the front end's and engine core's stages; the workers' per rank
        json.dump({"stages": {} if ranks else stages_of("restored" if archive else "native")}, f)
    for rank, how in enumerate(ranks):
        with open(path.replace(".json", f".rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": len(ranks), "stages": stages_of(how)}, f)
argv = sys.argv
def flag(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
port, model, key = int(flag("--port")), flag("--served-model-name", flag("--model")), flag("--api-key")
dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
state = {"sleeping": False}
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, code, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
    def call(self, method, body=None):
        record(call=f"{method} {self.path}", body=body, sleeping=state["sleeping"],
               auth=self.headers.get("Authorization"))
        return urlparse(self.path)
    def do_GET(self):
        if self.path == "/health":
            return self.reply(200)
        url = self.call("GET")
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            return self.reply(401, {"error": "unauthorized"})
        if url.path == "/v1/models":
            return self.reply(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        self.reply(404)
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        url = self.call("POST", body)
        if url.path == "/quit":
            self.reply(200)
            os._exit(int(parse_qs(url.query)["code"][0]))
        if url.path in ("/sleep", "/wake_up"):
            if not dev:
                return self.reply(404)
            state["sleeping"] = url.path == "/sleep"
            return self.reply(200)
        if url.path != "/v1/completions":
            return self.reply(404)
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            return self.reply(401, {"error": "unauthorized"})
        time.sleep(float(os.environ.get("FAKE_VLLM_TOKEN_DELAY") or 0))
        status = int(os.environ.get("FAKE_VLLM_TOKEN_STATUS") or 200)
        if body.get("model") != model:
            status = 404
        self.reply(status, {"choices": [{"index": 0, "text": "x"}]} if status == 200 else {"error": "fake"})
    def log_message(self, *a):
        pass
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
server.daemon_threads = True
server.serve_forever()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_vllm_env(tmp_path: Path) -> dict[str, str]:
    """The environment of an `ember serve` whose PATH finds the stand-in `vllm` first."""
    if native.find_library() is None:
        pytest.skip("libember not built")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "vllm"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD", "VLLM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_VLLM_OUT=str(tmp_path / "calls.jsonl"),
               PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}")
    return env


def serve(env: dict[str, str], run_dir: Path, port: int, **extra_env: str) -> subprocess.Popen[str]:
    """`ember serve` with --engine from EMBER_ENGINE, as the operator's pod sets it."""
    cmd = [sys.executable, "-c", "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()",
           "serve", "--run-dir", str(run_dir), "--deadline", "5", "--", "--model", "m", "--port", str(port)]
    return subprocess.Popen(cmd, env={**env, "EMBER_ENGINE": "vllm", **extra_env}, text=True,
                            stderr=subprocess.PIPE)


def calls(env: dict[str, str]) -> list[dict[str, Any]]:
    path = Path(env["FAKE_VLLM_OUT"])
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def http_calls(env: dict[str, str]) -> list[dict[str, Any]]:
    """The HTTP calls the stand-in answered (not /health), in order."""
    return [c for c in calls(env) if "call" in c]


def wait_report(w: handoff.HandoffWriter, stage: str, seen: list[dict[str, Any]], timeout: float = 20.0
                ) -> dict[str, Any]:
    """The first report of `stage`; every report read goes into `seen`."""
    def found() -> dict[str, Any] | None:
        seen.extend(w.new_reports())
        return next((r for r in seen if r["stage"] == stage), None)

    got: dict[str, Any] = wait_for(found, timeout, f"a {stage} report")
    return got


def engine_state(run_dir: Path) -> dict[str, Any]:
    return handoff.read_engine_state(run_dir) or {}


def wait_engine(run_dir: Path, state: str, timeout: float = 20.0) -> dict[str, Any]:
    got: dict[str, Any] = wait_for(lambda: (s := engine_state(run_dir)).get("state") == state and s,
                                   timeout, f"engine state {state}")
    return got


def quit_vllm(port: int, code: int) -> None:
    """The stand-in dies with `code` (as vLLM would, crashing)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/quit?code={code}", data=b"", method="POST")
    with contextlib.suppress(OSError):  # it may die before its answer is read
        urllib.request.urlopen(req, timeout=5).close()


def archive(w: handoff.HandoffWriter, identity: str = "abc") -> Path:
    d = w.archive_dir(identity)
    d.mkdir(parents=True)
    (d / "manifest").write_text("{}")
    return d
