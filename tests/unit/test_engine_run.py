"""CPU: an engine process of a bench or GPU test (`ember_bench.vllm.run_session`) is killed with
everything it started when it runs too long or ends (a vLLM worker stuck in a collective outlives
its parent otherwise and holds its GPU), and its output is logged."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ember_bench.vllm import run_session

CHILD = """
import subprocess, sys, time
print("started", flush=True)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(float(sys.argv[2]))
"""


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or " Z " in stat.read_text():  # gone, or a zombie
            return True
        time.sleep(0.05)
    return False


def test_an_engine_past_its_time_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pidfile, log = tmp_path / "pid", tmp_path / "engine.log"
    rc = run_session([sys.executable, "-c", CHILD, str(pidfile), "60"], dict(os.environ), log, timeout=2)
    assert rc == "timeout" and "started" in log.read_text()
    assert _gone(int(pidfile.read_text()))


def test_an_engine_that_ends_leaves_nothing_behind_and_gives_its_status(tmp_path: Path) -> None:
    pidfile, log = tmp_path / "pid", tmp_path / "engine.log"
    rc = run_session([sys.executable, "-c", CHILD + "raise SystemExit(3)", str(pidfile), "0"],
                     dict(os.environ), log, timeout=30)
    assert rc == 3 and "started" in log.read_text()
    assert _gone(int(pidfile.read_text()))  # its worker-like grandchild did not outlive it
