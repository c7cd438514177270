"""Both sides of the sidecar ↔ engine handoff in one run directory (no Kubernetes, no store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ember import handoff


def _make_archive(writer: handoff.HandoffWriter, identity: str = "abc") -> Path:
    d = writer.archive_dir(identity)
    (d / "blobs").mkdir(parents=True)
    (d / "manifest").write_text("{}")
    return d


def test_ready_archive_is_handed_over_and_handoff_is_reported(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    d = _make_archive(w)
    w.fetching("abc", "s3://b/p/archives/abc/manifest")
    w.ready("abc", d, rank=1, world=2)
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    assert r.restored and r.archive_dir == d and r.identity == "abc"
    assert (r.rank, r.world) == (1, 2)
    assert r.manifest_path == d / "manifest"
    reports = w.new_reports()
    assert [x["stage"] for x in reports] == ["handoff"] and reports[0]["result"] == "ok"
    assert w.new_reports() == []  # each report is returned once


def test_engine_waits_for_publish_from_another_thread(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    w.fetching("abc", "u")
    d = _make_archive(w)
    threading.Timer(0.2, lambda: w.ready("abc", d)).start()
    t0 = time.monotonic()
    r = handoff.wait_for_archive(tmp_path, deadline=5.0)
    assert r.restored and 0.15 < time.monotonic() - t0 < 2.0


def test_fallback_carries_the_reason(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    w.fallback("digest-mismatch: blob 1234", identity="abc")
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    assert not r.restored and r.reason.startswith("digest-mismatch") and r.identity == "abc"


def test_no_sidecar_times_out_into_fallback(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = handoff.wait_for_archive(tmp_path, deadline=0.2)
    assert not r.restored and r.reason.startswith(handoff.REASON_TIMEOUT)
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_stuck_fetch_times_out_counted_from_claim(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    w.fetching("abc", "u")
    r = handoff.wait_for_archive(tmp_path, deadline=0.2)
    assert not r.restored and "fetching" in r.reason
    assert any(x["stage"] == "handoff" and x["result"] == "fallback" for x in w.new_reports())


def test_unclaimed_warm_pod_waits_for_claim_not_deadline(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    w.unclaimed()
    d = _make_archive(w)

    def claim() -> None:
        w.fetching("abc", "u")
        time.sleep(0.1)
        w.ready("abc", d)

    threading.Timer(0.4, claim).start()
    # deadline (0.3 s) is shorter than the unclaimed wait: it only counts from the claim.
    r = handoff.wait_for_archive(tmp_path, deadline=0.3, claim_timeout=5.0)
    assert r.restored


def test_claim_timeout(tmp_path: Path) -> None:
    handoff.HandoffWriter(tmp_path).unclaimed()
    r = handoff.wait_for_archive(tmp_path, deadline=0.1, claim_timeout=0.2)
    assert not r.restored and "no claim" in r.reason


def test_ready_without_manifest_falls_back(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    w.ready("abc", tmp_path / "archives" / "abc")
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    assert not r.restored and r.reason.startswith("archive-missing")


def test_torn_or_garbage_status_is_ignored_until_valid(tmp_path: Path) -> None:
    (tmp_path / handoff.STATUS_FILE).write_text("{not json")
    r = handoff.wait_for_archive(tmp_path, deadline=0.1)
    assert not r.restored and r.reason.startswith(handoff.REASON_TIMEOUT)


def test_marker_cleared_on_normal_exit_and_on_exception(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    d = _make_archive(w)
    w.ready("abc", d)
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    with handoff.load_attempt(r):
        assert w.load_marker() is not None
    assert w.load_marker() is None
    try:
        with handoff.load_attempt(r):
            raise RuntimeError("LOAD failed cleanly")
    except RuntimeError:
        pass
    assert w.load_marker() is None
    assert handoff.wait_for_archive(tmp_path, deadline=1.0).restored


def test_engine_killed_during_load_makes_next_attempt_fall_back(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    d = _make_archive(w)
    w.ready("abc", d)
    # A real engine process that dies (SIGKILL-like, os._exit) inside load_attempt.
    code = (
        "import os; from ember import handoff\n"
        f"r = handoff.wait_for_archive({str(tmp_path)!r}, deadline=5)\n"
        "assert r.restored\n"
        "with handoff.load_attempt(r):\n"
        "    os._exit(139)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 139
    assert w.load_marker() is not None and w.load_marker()["identity"] == "abc"
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    assert not r.restored and r.reason.startswith(handoff.REASON_CRASHED)
    assert any(x["stage"] == "load" and x["result"] == "fallback" for x in w.new_reports())


def test_report_never_raises_and_env_run_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EMBER_RUN_DIR", str(tmp_path))
    p = handoff.report("first_token", 0.25, "ok", ttft_tokens=1)
    assert p is not None and json.loads(p.read_text())["ttft_tokens"] == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert handoff.report("ready", 0.0, run_dir=blocker / "sub") is None  # parent is a file


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    for i in range(20):
        handoff.write_json_atomic(tmp_path / "s.json", {"i": i})
    assert os.listdir(tmp_path) == ["s.json"]


def test_the_claims_engine_arguments_reach_the_engine_restored_or_not(tmp_path: Path) -> None:
    w = handoff.HandoffWriter(tmp_path)
    d = _make_archive(w)
    w.ready("abc", d, engine_args=("--max-model-len", "4096"))
    assert handoff.wait_for_archive(tmp_path, deadline=1.0).engine_args == ("--max-model-len", "4096")
    w.fallback("compat: another GPU", identity="abc", engine_args=("--enforce-eager",))
    r = handoff.wait_for_archive(tmp_path, deadline=1.0)
    assert not r.restored and r.engine_args == ("--enforce-eager",)
