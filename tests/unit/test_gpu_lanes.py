"""e2e/gpu-lanes.sh `poll` (the device sessions' wait on detached lanes): plain, it waits until
every lane has ended or its time is up; with `next` it comes back as soon as any lane ends a line,
so the last calls of a session's device time are not spent on a line that cannot finish."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "gpu-lanes.sh"


def _poll(run: Path, *args: str) -> tuple[float, str]:
    env = {**os.environ, "RUN": str(run), "POLL_EVERY": "0.1"}
    env.pop("OUT", None)  # no pack
    t = time.perf_counter()
    out = subprocess.run(["bash", str(SCRIPT), "poll", *args], env=env, capture_output=True, text=True,
                         timeout=60)
    return time.perf_counter() - t, out.stdout


def test_poll_next_returns_when_a_line_ends_and_plain_poll_waits(tmp_path: Path) -> None:
    log = tmp_path / "x1.log"
    log.write_text("## 08:00:00 >>> first\n## 08:00:01 rc=0 after 1 s: first\n## 08:00:01 >>> second\n")

    def end_the_line() -> None:
        time.sleep(1.0)
        with log.open("a") as f:
            f.write("## 08:00:05 rc=0 after 4 s: second\n")

    threading.Thread(target=end_the_line).start()
    took, out = _poll(tmp_path, "20", "next")
    assert 0.8 <= took < 10, took  # the line that ended before the poll does not count
    assert "===== x1: running" in out and "rc=0 after 4 s: second" in out
    took, _ = _poll(tmp_path, "3")  # plain: the lane has not ended (no x1.rc), so until its time
    assert took >= 2  # (bash counts whole seconds)
    (tmp_path / "x1.rc").write_text("done\n")
    took, out = _poll(tmp_path, "20")
    assert took < 10 and "===== x1: done" in out


def test_poll_on_a_fresh_machine_says_so_and_does_not_wait(tmp_path: Path) -> None:
    env = {**os.environ, "RUN": str(tmp_path / "run")}
    out = subprocess.run(["bash", str(SCRIPT), "poll", "30"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 3 and "no lanes" in out.stdout
