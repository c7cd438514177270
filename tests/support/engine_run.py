"""An engine process for a GPU test: its own session, its output (stdout and stderr: vLLM logs to
stdout) in a log, and on a time-out every process under it killed. A vLLM worker spinning in a
collective outlives its parent and would hold its GPU through the tests after.
`EMBER_GPU_ENGINE_TIMEOUT_S` (default 900) bounds each engine."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def engine_timeout() -> float:
    return float(os.environ.get("EMBER_GPU_ENGINE_TIMEOUT_S", "900"))


def run_logged(argv: list[str], env: dict[str, str], log: Path,
               timeout: float | None = None) -> tuple[int, str]:
    """(exit status, the log's text); raises TimeoutError once the whole session is killed."""
    limit = engine_timeout() if timeout is None else timeout
    with open(log, "w") as out:
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise TimeoutError(f"the engine ran past {limit:.0f} s; killed with its workers "
                               f"(log {log}):\n{log.read_text()[-4000:]}") from None
    return rc, log.read_text()
