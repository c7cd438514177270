"""`ember serve` with a standalone sidecar on a GPU: the archive is restored and the first token
served; with a corrupted archive the server falls back to native capture and still serves the
same tokens. Both as real processes (`ember-sidecar --standalone`, `ember serve`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ember_bench.cb import REF_PROMPT, phase_env, run_child

pytestmark = pytest.mark.gpu

MODEL = ["--model", "llama-3-8b", "--layers", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(port: int, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("serve")
    store = work / "store"
    opts = {
        "model": "llama-3-8b",
        "layers": 2,
        "store": store.as_uri(),
        "store_dir": str(store),
        "work_dir": str(work),
    }
    save = run_child("save", opts, work, 300, env=phase_env("save"))
    assert "error" not in save and save["archive"]["published"], save.get("traceback", save)
    return {"store": store, "identity": save["archive"]["identity"], "reference": save["reference"]}


def _serve_with_sidecar(store: Path, identity: str, run_dir: Path) -> tuple[dict[str, Any], list[int], str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("EMBER_")}
    port = _free_port()
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember_sidecar.main",
            "--standalone",
            "--store",
            store.as_uri(),
            "--identity",
            identity,
            "--run-dir",
            str(run_dir),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from ember.cli import app; app()",
            "serve",
            *MODEL,
            "--run-dir",
            str(run_dir),
            "--port",
            str(port),
            "--deadline",
            "60",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 240
        health: dict[str, Any] = {}
        while time.monotonic() < end:
            code, health = _http(port, "/health")
            if code == 200 or server.poll() is not None:
                break
            time.sleep(0.2)
        assert health.get("status") == "ready", health
        code, body = _http(port, "/v1/completions", {"prompt": REF_PROMPT, "max_tokens": 8})
        assert code == 200, body
        tokens = body["choices"][0]["token_ids"]
    finally:
        for proc in (server, sidecar):
            proc.send_signal(signal.SIGINT)
        logs = ""
        for proc in (server, sidecar):
            try:
                logs += proc.communicate(timeout=30)[0][-3000:]
            except subprocess.TimeoutExpired:
                proc.kill()
    return health, tokens, logs


def test_sidecar_hands_over_and_serve_restores(saved: dict[str, Any], tmp_path: Path) -> None:
    health, tokens, logs = _serve_with_sidecar(saved["store"], saved["identity"], tmp_path / "run")
    assert health["mode"] == "restored", (health, logs)
    assert health["graphs"] > 0 and "load" in health["stages"]
    assert tokens == saved["reference"]


def test_corrupted_archive_falls_back_to_native_and_serves_the_same_tokens(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(saved["store"], store)
    blob = max((store / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    health, tokens, logs = _serve_with_sidecar(store, saved["identity"], tmp_path / "run")
    assert health["mode"] == "native" and "digest-mismatch" in health["reason"], (health, logs)
    assert tokens == saved["reference"]
