"""`ember serve` as a real process (tests/gpu): handed an archive by a standalone sidecar
(`ember-sidecar --standalone`, a pod sidecar's fetch path), or native (`--no-handoff`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def clean_env() -> dict[str, str]:
    """This environment without libember and ember's variables: each process sets its own."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("EMBER_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(port: int, path: str, body: Any = None, *, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a request to the server on `port` (POST with `body` or `raw`);
    (0, {}) when nothing answers."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def _sidecar(store: Path, identity: str, run_dir: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ember_sidecar.main", "--standalone", "--store", store.as_uri(),
           "--identity", identity, "--run-dir", str(run_dir), "--port", "0", "--host", "127.0.0.1"]
    return subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def serve(model: list[str], run_dir: Path, prompt: list[int], *, store: Path | None = None,
          identity: str = "", env: dict[str, str] | None = None,
          max_tokens: int = 8) -> tuple[dict[str, Any], list[int], str]:
    """`ember serve <model>` until ready, then one completion of `prompt`: (health, its tokens,
    the processes' log tails). With `store`, a standalone sidecar fetches the archive `identity`
    from it and hands it over; without, the server starts natively. `env`: the server's
    (default `clean_env()`)."""
    port = free_port()
    procs = [_sidecar(store, identity, run_dir)] if store is not None else []
    handoff = ["--run-dir", str(run_dir), "--deadline", "60"] if store is not None else ["--no-handoff"]
    cmd = [sys.executable, "-c", "from ember.cli import app; app()", "serve", *model, *handoff,
           "--port", str(port)]
    server = subprocess.Popen(cmd, env=clean_env() if env is None else env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    procs.insert(0, server)
    try:
        end = time.monotonic() + 240
        health: dict[str, Any] = {}
        while time.monotonic() < end:
            code, health = http(port, "/health")
            if code == 200 or server.poll() is not None:
                break
            time.sleep(0.2)
        assert health.get("status") == "ready", health
        code, body = http(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
        assert code == 200, body
        tokens = body["choices"][0]["token_ids"]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        logs = ""
        for proc in procs:
            try:
                logs += proc.communicate(timeout=30)[0][-3000:]
            except subprocess.TimeoutExpired:
                proc.kill()
    return health, tokens, logs
