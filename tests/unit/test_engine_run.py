"""CPU: a GPU test's engine process is killed with everything it started when it runs too long
(a vLLM worker stuck in a collective outlives its parent otherwise), and its output is logged."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from support.engine_run import run_logged

CHILD = """
import subprocess, sys, time
print("started", flush=True)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " not in stat  # a zombie is dead


def test_an_engine_past_its_time_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pidfile, log = tmp_path / "pid", tmp_path / "engine.log"
    with pytest.raises(TimeoutError, match="ran past 2 s") as err:
        run_logged([sys.executable, "-c", CHILD, str(pidfile)], dict(os.environ), log, timeout=2)
    assert "started" in str(err.value)  # the log's tail is in the error
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_an_engine_that_ends_gives_its_status_and_log(tmp_path: Path) -> None:
    rc, text = run_logged([sys.executable, "-c", "print('RESULT {}'); raise SystemExit(3)"],
                          dict(os.environ), tmp_path / "e.log", timeout=30)
    assert rc == 3 and "RESULT {}" in text
