"""`ember serve --engine vllm -- <vllm serve args>`: vLLM behind the sidecar hand-off.

ember does not wrap vLLM's server; it supervises `vllm serve`, whose `vllm.general_plugins`
plugin (`ember.engines.vllm.plugin`) does SAVE/LOAD inside vLLM's own processes:
1. wait for the sidecar (`ember.handoff.wait_for_archive`): a verified archive, or the reason to
   capture natively (a refusal, a timeout, a previous engine that died while loading);
2. with an archive: `vllm serve` under libember in `load` mode with `EMBER_VLLM_ARCHIVE` set,
   the crash marker written first; without: `vllm serve` as it is (native capture); the claim's
   engine arguments (the deployment's `engine.args`, through the hand-off) follow the command
   line's;
3. once vLLM's `/health` answers, the marker goes and the sidecar hears `ready` (its readiness
   probe passes); if vLLM dies before that the marker stays, so the pod's next start captures
   natively instead of crash-looping on the same archive. Exit code and signals pass through.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ember import handoff
from ember.engines.vllm.args import process_env

log = logging.getLogger("ember.serving.vllm")
REPORT_FILE = "vllm-report.json"  # the plugin's stage report, in the hand-off's run dir


def vllm_env(result: handoff.HandoffResult | None, env: dict[str, str]) -> dict[str, str]:
    """vLLM's environment: LOAD of the handed-off archive, or a plain native start."""
    if result is None or result.archive_dir is None:
        return process_env("native", env)
    env = process_env("load", env)
    env["EMBER_VLLM_ARCHIVE"] = str(result.archive_dir)
    env.setdefault("EMBER_VLLM_REPORT", str(result.run_dir / REPORT_FILE))
    return env


def _vllm_command(vllm: str) -> list[str]:
    """vLLM's CLI: its console script, else its module under this interpreter (an install without
    scripts, e.g. a site tree on PYTHONPATH)."""
    found = shutil.which(vllm)
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _port(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a == "--port" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return 8000  # vllm serve's default


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def supervise(
    vllm_args: list[str], run_dir: Path | None, *, use_handoff: bool, deadline: float, vllm: str = "vllm"
) -> int:
    """Run `vllm serve` as the hand-off says; returns its exit code."""
    result = handoff.wait_for_archive(run_dir, deadline) if use_handoff else None
    if result is not None and result.archive_dir is None:
        log.warning("Capturing natively: %s", result.reason)
        handoff.report("load", 0.0, "fallback", result.reason, run_dir=result.run_dir)
    env = vllm_env(result, dict(os.environ))
    # the crash marker, removed once vLLM is healthy: a vLLM that dies first leaves it, and the
    # next start in the pod captures natively
    attempt = None
    if result is not None and result.archive_dir is not None:
        attempt = handoff.load_attempt(result, engine="vllm").begin()
    report = Path(env["EMBER_VLLM_REPORT"]) if env.get("EMBER_VLLM_REPORT") else None
    if report is not None:  # vLLM's processes add to it: a previous start's must go
        report.unlink(missing_ok=True)
    t0 = time.monotonic()
    # The command line's arguments, then the claim's (the deployment's `engine.args`).
    args = [*vllm_args, *(result.engine_args if result is not None else ())]
    proc = subprocess.Popen([*_vllm_command(vllm), "serve", *args], env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    port, ready = _port(args), False
    while proc.poll() is None:
        if not ready and _healthy(port):
            ready = True
            if attempt is not None:
                attempt.done()
            _report_ready(result, time.monotonic() - t0, run_dir, report)
        time.sleep(0.2 if not ready else 1.0)
    if not ready:
        log.error("vllm serve exited %s before it was healthy%s", proc.returncode,
                  " (the crash marker stays: the next start captures natively)" if attempt else "")
    return int(proc.returncode or 0)


def _report_ready(result: handoff.HandoffResult | None, seconds: float, run_dir: Path | None,
                  report: Path | None) -> None:
    """`ready` to the sidecar, with vLLM's own stage report (restored or why not) when it wrote one."""
    extra: dict[str, Any] = {"engine": "vllm", "restored": bool(result and result.archive_dir)}
    if report is not None and report.is_file():
        with contextlib.suppress(OSError, ValueError):
            extra["vllm"] = json.loads(report.read_text())
    handoff.report("ready", seconds, run_dir=run_dir if result is None else result.run_dir, **extra)
