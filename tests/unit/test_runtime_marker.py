"""CPU: the one hand-off API's crash marker around a LOAD's first launches, how a restart reads it,
and where an archive directory's store and identity come from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ember import handoff
from ember.runtime.adapter import LOAD, Refused


def _marker(run_dir: Path) -> dict | None:
    return handoff.read_json(run_dir / handoff.MARKER_FILE)


def test_marker_present_only_inside(tmp_path: Path) -> None:
    with handoff.load_attempt(run_dir=tmp_path, identity="abc") as attempt:
        assert json.loads(attempt.path.read_text())["identity"] == "abc"
    assert _marker(tmp_path) is None


def test_python_error_clears_the_marker(tmp_path: Path) -> None:
    with pytest.raises(Refused), handoff.load_attempt(run_dir=tmp_path, identity="abc"):
        raise Refused(LOAD, "divergence")
    assert _marker(tmp_path) is None


def test_a_handoff_result_names_its_archive_in_the_marker(tmp_path: Path) -> None:
    result = handoff.HandoffResult(tmp_path / "cache" / "archives" / "h1", identity="h1", run_dir=tmp_path)
    attempt = handoff.load_attempt(result, engine="vllm").begin()
    marker = _marker(tmp_path)
    assert marker is not None and marker["identity"] == "h1" and marker["engine"] == "vllm"
    assert marker["archive_dir"].endswith("archives/h1")
    attempt.done()
    assert _marker(tmp_path) is None


def test_process_death_leaves_marker_and_next_start_falls_back(tmp_path: Path) -> None:
    code = (
        "import os, sys; from ember import handoff\n"
        "with handoff.load_attempt(run_dir=sys.argv[1], identity='id-1'):\n    os._exit(134)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert proc.returncode == 134
    assert _marker(tmp_path)["identity"] == "id-1"  # type: ignore[index]
    result = handoff.wait_for_archive(tmp_path, deadline=0.1, report_handoff=False)
    assert not result.restored and handoff.REASON_CRASHED in result.reason


def test_the_claim_time_comes_with_the_result(tmp_path: Path) -> None:
    archive = tmp_path / "cache" / "archives" / "h1"
    archive.mkdir(parents=True)
    (archive / "manifest").write_text("{}")
    handoff.write_json_atomic(tmp_path / handoff.STATUS_FILE, {
        "state": "ready", "identity": "h1", "archive_dir": str(archive), "claimed_at": 1700000000.5})
    result = handoff.wait_for_archive(tmp_path, deadline=1, report_handoff=False)
    assert result.restored and result.claimed_at == 1700000000.5


def test_an_archive_directory_names_its_store_and_identity(tmp_path: Path) -> None:
    store, ident = handoff.archive_location(tmp_path / "archives" / "ab12" / "manifest")
    assert (store, ident) == (tmp_path.as_uri(), "ab12")
    with pytest.raises(ValueError, match="archives"):
        handoff.archive_location(tmp_path / "elsewhere" / "ab12")
