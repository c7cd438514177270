"""The `ember-sidecar` process in standalone mode (local store): probes, metrics, handoff, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from support.sidecar import wait_for

from ember import handoff
from ember.store import LocalStore
from ember_testing.archives import write_blob_archive


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def start(run_dir: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    full_env = {**os.environ, "EMBER_LOG_LEVEL": "DEBUG", **env}
    full_env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(
        [sys.executable, "-m", "ember_sidecar.main", "--run-dir", str(run_dir), "--port", "0",
         "--host", "127.0.0.1", *args],  # test servers listen on loopback only
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_standalone_restore_probes_metrics_and_sigterm(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096, 300_000, 70_000])
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--standalone", "--store", store.uri, "--identity", m.identity_hash)
    try:
        port = int(wait_for(lambda: (run_dir / "sidecar.port").is_file()
                            and (run_dir / "sidecar.port").read_text(), what="sidecar port"))
        assert get(port, "/livez") == (200, "ok\n")
        res = handoff.wait_for_archive(run_dir, deadline=20)
        assert res.restored and res.identity == m.identity_hash
        code, body = get(port, "/readyz")
        assert code == 503 and "restore in progress" in body
        with handoff.load_attempt(res):
            handoff.report("load", 0.125, run_dir=run_dir)
        handoff.report("first_token", 0.03, run_dir=run_dir)
        handoff.report("ready", 0.0, run_dir=run_dir)
        wait_for(lambda: get(port, "/readyz")[0] == 200, what="ready")
        _, metrics = get(port, "/metrics")
        assert 'ember_restores_total{reason="",result="restored"} 1.0' in metrics
        assert 'ember_restore_stage_seconds_sum{stage="load"} 0.125' in metrics
        assert 'ember_restore_stage_seconds_count{stage="fetch"} 1.0' in metrics
        assert "ember_sidecar_ready 1.0" in metrics
        assert get(port, "/status")[0] == 200
        assert get(port, "/nope")[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "Restore result: restored" in out


def test_standalone_corrupt_archive_falls_back_and_keeps_running(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096, 300_000])
    (store.root / "blobs" / m.blobs[1].sha256).write_bytes(b"\0" * m.blobs[1].compressed_size)
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--standalone", "--archive", store.manifest_uri(m.identity_hash))
    try:
        res = handoff.wait_for_archive(run_dir, deadline=20)
        assert not res.restored and res.reason.startswith("digest-mismatch")
        port = int((run_dir / "sidecar.port").read_text())
        wait_for(lambda: 'reason="digest-mismatch",result="fallback"} 1.0' in get(port, "/metrics")[1],
                 what="fallback metric")
        assert proc.poll() is None, "a fallback never ends the sidecar"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out


def test_misconfiguration_exits_with_a_clear_message(tmp_path: Path) -> None:
    proc = start(tmp_path / "run", "--standalone")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--archive MANIFEST_URI" in out
    env = {"EMBER_POD_NAME": ""}
    proc = start(tmp_path / "run2", **env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "EMBER_POD_NAME" in out
