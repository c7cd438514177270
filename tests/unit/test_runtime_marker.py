"""CPU: the crash-safety marker around a LOAD's first launches, and how a restart reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ember import handoff
from ember.runtime.adapter import LOAD, Refused
from ember.runtime.load import attempt_marker, previous_attempt_crashed


def test_marker_present_only_inside(tmp_path: Path) -> None:
    with attempt_marker(tmp_path, "abc") as path:
        assert json.loads(path.read_text())["identity"] == "abc"
        assert previous_attempt_crashed(tmp_path) is not None
    assert not path.exists() and previous_attempt_crashed(tmp_path) is None


def test_python_error_clears_the_marker(tmp_path: Path) -> None:
    try:
        with attempt_marker(tmp_path, "abc"):
            raise Refused(LOAD, "divergence")
    except Refused as exc:
        assert exc.reason == "divergence"
    assert previous_attempt_crashed(tmp_path) is None


def test_process_death_leaves_marker_and_next_start_falls_back(tmp_path: Path) -> None:
    code = (
        "import os, sys; from ember.runtime.load import attempt_marker\n"
        "with attempt_marker(sys.argv[1], 'id-1'):\n    os._exit(134)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert proc.returncode == 134
    assert previous_attempt_crashed(tmp_path)["identity"] == "id-1"
    result = handoff.wait_for_archive(tmp_path, deadline=0.1, report_handoff=False)
    assert not result.restored and handoff.REASON_CRASHED in result.reason
