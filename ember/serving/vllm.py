"""`ember serve --engine vllm -- <vllm serve args>`: vLLM behind the sidecar hand-off.

ember does not wrap vLLM's server; it supervises `vllm serve`, whose `vllm.general_plugins`
plugin (`ember.engines.vllm.plugin`) does SAVE/LOAD inside vLLM's own processes:
1. wait for the sidecar (`ember.handoff.wait_for_archive`): a verified archive, or the reason to
   capture natively (a refusal, a timeout, a previous engine that died while loading);
2. engine state `loading`; with an archive: `vllm serve` under libember in `load` mode with
   `EMBER_VLLM_ARCHIVE` set, the crash marker written first; without: `vllm serve` as it is
   (native capture); the claim's engine arguments (the deployment's `engine.args`, through the
   hand-off) follow the command line's;
3. once vLLM's `/health` answers, the sidecar hears how vLLM's LOAD went (`load`: ok, or the
   fallback and why, from the plugin's report);
   - a claimed (cold) pod: the marker goes, engine state `ready`, and `ready` (the sidecar's
     readiness probe passes);
   - an identity-keyed warm pod (the archive handed off before any claim): one real token through
     vLLM's OpenAI API (the served model from /v1/models, POST /v1/completions, max_tokens 1) proves
     the engine serves; only then the marker goes and the engine state says `ready` (the operator
     may claim the pod). With EMBER_WARM_ENGINE=sleeping (the deployment's `warmPool.engine`)
     vLLM runs with `--enable-sleep-mode` and its development endpoints (VLLM_SERVER_DEV_MODE=1),
     and goes to sleep (level 1: KV cache freed, weights to host memory) before `ready`. Then it
     waits for the claim, still supervising vLLM; the claim wakes a sleeping vLLM, and `ready` is
     reported timed from the claim.
If vLLM dies first (before /health, during the warm-up token, while warm) or a sleep or wake-up
fails, the engine state says `failed` with the reason (the operator replaces such a warm pod) and
this process exits with vLLM's code (1 when it stopped vLLM itself); if vLLM dies before the
marker goes, the marker stays, so the pod's next start captures natively instead of
crash-looping on the same archive. Exit code and signals pass through.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ember import contract, handoff
from ember.engines.vllm import report as reports
from ember.engines.vllm.args import SLEEP_MODE_ARG, process_env
from ember.engines.vllm.ranks import pod_env
from ember.runtime.verify import CANARY_HEAD, PEER_CANARY

log = logging.getLogger("ember.serving.vllm")
REPORT_FILE = "vllm-report.json"  # the plugin's stage report, in the hand-off's run dir
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /sleep and /wake_up only in development mode
# The warm-up token's prompt as token ids: every vocabulary has them, no tokenizer needed
# (a vLLM started with --skip-tokenizer-init takes them too).
WARM_UP_PROMPT = list(range(11, 27))
REQUEST_TIMEOUT_S = 300.0  # the warm-up token, a sleep or a wake-up (weights to or from host memory)
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL, when this process stops vLLM itself
READY, SLEEPING = contract.WARM_ENGINE_READY, contract.WARM_ENGINE_SLEEPING


def warm_engine_mode(env: dict[str, str] | os._Environ[str]) -> str:
    """How a warm engine idles until its claim (EMBER_WARM_ENGINE): ready (the default) or sleeping."""
    mode = env.get(contract.ENV_WARM_ENGINE) or READY
    if mode not in (READY, SLEEPING):
        log.warning("%s=%r is neither %s nor %s: idling %s", contract.ENV_WARM_ENGINE, mode, READY, SLEEPING,
                    READY)
        return READY
    return mode


def vllm_env(
    result: handoff.HandoffResult | None, env: dict[str, str], *, sleeping: bool = False,
    args: list[str] | None = None,
) -> dict[str, str]:
    """vLLM's environment: LOAD of the handed-off archive, or a plain native start; `sleeping`:
    with its development endpoints (/sleep, /wake_up); `args` (vLLM's): a shape of several ranks
    runs with the settings its archive was saved with (`ranks.pod_env`), restored or not."""
    env = {**env, **pod_env(args or [])}
    if result is None or result.archive_dir is None:
        env = process_env("native", env)
    else:
        env = process_env("load", env)
        env["EMBER_VLLM_ARCHIVE"] = str(result.archive_dir)
        env.setdefault("EMBER_VLLM_REPORT", str(result.run_dir / REPORT_FILE))
    if sleeping:
        env[DEV_MODE_ENV] = "1"
    return env


def serve_args(
    cli_args: list[str], result: handoff.HandoffResult | None, *, sleeping: bool = False,
) -> list[str]:
    """`vllm serve`'s arguments: the command line's, then the claim's (the deployment's
    `engine.args`, which carry the sleep mode flag when the deployment's warm pods sleep)."""
    args = [*cli_args, *(result.engine_args if result is not None else ())]
    if sleeping and SLEEP_MODE_ARG not in args:
        # The operator puts the flag into every process of a sleeping deployment (SAVE too): an
        # archive saved without it does not LOAD here (the allocations differ) and vLLM captures.
        log.warning("EMBER_WARM_ENGINE=sleeping without %s in vLLM's arguments: adding it", SLEEP_MODE_ARG)
        args.append(SLEEP_MODE_ARG)
    return args


def _vllm_command(vllm: str) -> list[str]:
    """vLLM's CLI: its console script, else its module under this interpreter (an install without
    scripts, e.g. a site tree on PYTHONPATH)."""
    found = shutil.which(vllm)
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _flag(args: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` (the last one given), None when absent."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _port(args: list[str]) -> int:
    return int(_flag(args, "--port") or 8000)  # vllm serve's default


# ---------------------------------------------------------------------------------------------
# vLLM's HTTP API, from this host
# ---------------------------------------------------------------------------------------------


class VllmHttpError(RuntimeError):
    """vLLM answered a call with an error, or not as expected."""


HTTP_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, VllmHttpError)


class VllmHttp:
    """The calls ember makes to the vLLM it supervises: /health, the OpenAI API (with the
    deployment's API key, if it set one) and, in development mode, /sleep and /wake_up."""

    def __init__(self, port: int, api_key: str = "") -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, path: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S
              ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {**self.headers, **({"Content-Type": "application/json"} if data is not None else {})}
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    def _ok(self, method: str, path: str, body: Any = None) -> bytes:
        status, out = self._call(method, path, body)
        if status != 200:
            text = out[:300].decode(errors="replace")
            raise VllmHttpError(f"{method} {path} answered HTTP {status}: {text}")
        return out

    def healthy(self) -> bool:
        try:
            return self._call("GET", "/health", timeout=1.0)[0] == 200
        except OSError:
            return False

    def served_model(self) -> str:
        return str(json.loads(self._ok("GET", "/v1/models"))["data"][0]["id"])

    def one_token(self) -> None:
        """One real token through the OpenAI API: the engine serves."""
        body = {"model": self.served_model(), "prompt": WARM_UP_PROMPT, "max_tokens": 1, "temperature": 0}
        out = json.loads(self._ok("POST", "/v1/completions", body))
        if not out.get("choices"):
            raise VllmHttpError(f"POST /v1/completions answered without a choice: {str(out)[:300]}")

    def sleep(self, level: int = 1) -> None:
        self._ok("POST", f"/sleep?level={level}")

    def wake_up(self) -> None:
        self._ok("POST", "/wake_up")


# ---------------------------------------------------------------------------------------------
# Supervision
# ---------------------------------------------------------------------------------------------


@dataclass
class VllmProcess:
    """One `vllm serve` under supervision: the hand-off it started from, its API, the crash marker
    while it is not proven, the plugin's report, and its stages in seconds."""

    proc: subprocess.Popen[bytes]
    result: handoff.HandoffResult | None
    run_dir: Path | None
    http: VllmHttp
    report: Path | None
    attempt: handoff.LoadAttempt | None
    started: float = field(default_factory=time.monotonic)
    stages: dict[str, float] = field(default_factory=dict)
    stopping: bool = False  # a signal came: vLLM's end is a shutdown, not an engine failure

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def code(self) -> int:
        return int(self.proc.returncode or 0)

    @property
    def handoff_dir(self) -> Path | None:
        return self.result.run_dir if self.result is not None else self.run_dir

    @property
    def restored(self) -> bool:
        """vLLM restored the archive's graphs, on every rank (the plugin says so)."""
        return reports.ranks_restored(self.plugin_report())

    def mark(self, stage: str, since: float) -> None:
        self.stages[stage] = round(time.monotonic() - since, 4)

    def say(self, state: Callable[..., Any], *reason: str, **info: Any) -> None:
        _say(self.result, self.run_dir, state, *reason, **info)

    def forward(self, sig: int, _frame: FrameType | None) -> None:
        self.stopping = True
        self.proc.send_signal(sig)

    def proven(self) -> None:
        """vLLM serves: the crash marker goes."""
        if self.attempt is not None:
            self.attempt.done()
            self.attempt = None

    def stop(self) -> None:
        """End vLLM (it cannot serve): SIGTERM, then SIGKILL after STOP_GRACE_S."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def plugin_report(self) -> dict[str, Any]:
        """What ember's plugin wrote while vLLM started, every rank's file under "ranks" (empty
        when nothing)."""
        return {} if self.report is None else reports.read(self.report)


def _say(result: handoff.HandoffResult | None, run_dir: Path | None, state: Callable[..., Any], *reason: str,
         **info: Any) -> None:
    """The engine's state to the sidecar (`engine-state.json`, for the hand-off's claim)."""
    if result is not None:
        state(*reason, result, **info)
    else:
        state(*reason, None, run_dir=run_dir, **info)


def supervise(
    vllm_args: list[str], run_dir: Path | None, *, use_handoff: bool, deadline: float, vllm: str = "vllm"
) -> int:
    """Run `vllm serve` as the hand-off says; returns its exit code."""
    result = handoff.wait_for_archive(run_dir, deadline) if use_handoff else None
    if result is not None and result.archive_dir is None:
        log.warning("Capturing natively: %s", result.reason)
        handoff.report("load", 0.0, "fallback", result.reason, run_dir=result.run_dir)
    warm = result is not None and result.warm  # identity-keyed warm pod: the claim comes later
    mode = warm_engine_mode(os.environ) if warm else READY
    vp = start(vllm_args, result, run_dir, vllm, sleeping=mode == SLEEPING)
    if not _until_healthy(vp):
        return _failed(vp, f"vllm serve exited {vp.code} before it was healthy")
    vp.mark("healthy_s", vp.started)
    if warm:
        failed = _warm(vp, mode)
        if failed is not None:
            return failed
    else:
        vp.proven()
        report_load(vp)
        vp.stages["engine_ready_s"] = vp.stages["healthy_s"]
        vp.say(handoff.engine_ready, mode=READY, restored=vp.restored)
        claimed_at = result.claimed_at if result is not None else 0.0
        report_ready(vp, vp.stages["healthy_s"], claimed_at=claimed_at, mode=READY)
    while vp.alive:
        time.sleep(1.0)
    if not vp.stopping:
        log.error("vllm serve exited %s while serving", vp.code)
        vp.say(handoff.engine_failed, f"vllm serve exited {vp.code} while serving")
    return vp.code


def start(cli_args: list[str], result: handoff.HandoffResult | None, run_dir: Path | None, vllm: str, *,
          sleeping: bool) -> VllmProcess:
    """Engine state `loading`, the crash marker when an archive is handed off, then `vllm serve`
    with its environment and arguments; SIGTERM and SIGINT go on to it."""
    args = serve_args(cli_args, result, sleeping=sleeping)
    env = vllm_env(result, dict(os.environ), sleeping=sleeping, args=args)
    report = Path(env["EMBER_VLLM_REPORT"]) if env.get("EMBER_VLLM_REPORT") else None
    if report is not None:  # vLLM's processes add to it: a previous start's must go, rank files too
        reports.clear(report)
    http = VllmHttp(_port(args), _flag(args, "--api-key") or env.get("VLLM_API_KEY", ""))
    _say(result, run_dir, handoff.engine_loading)
    # the crash marker, removed once vLLM is proven (healthy; a warm pod: one token served): a vLLM
    # that dies first leaves it, and the next start in the pod captures natively
    attempt = None
    if result is not None and result.archive_dir is not None:
        attempt = handoff.load_attempt(result, engine="vllm").begin()
    proc = subprocess.Popen([*_vllm_command(vllm), "serve", *args], env=env)
    vp = VllmProcess(proc, result, run_dir, http, report, attempt)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, vp.forward)
    return vp


def _until_healthy(vp: VllmProcess) -> bool:
    """Poll /health while vLLM lives; False when it exited first."""
    while vp.alive:
        if vp.http.healthy():
            return True
        time.sleep(0.2)
    return False


def _failed(vp: VllmProcess, reason: str) -> int:
    """vLLM cannot serve: engine state `failed` (unless a signal is stopping it), vLLM stopped if it
    still runs. The exit code: vLLM's when it ended by itself, else 1."""
    code = 1 if vp.alive else vp.code
    if vp.alive:
        vp.stop()
    if vp.stopping:
        return vp.code
    marker = " (the crash marker stays: the next start captures natively)" if vp.attempt else ""
    log.error("%s%s", reason, marker)
    vp.say(handoff.engine_failed, reason)
    return code


def _warm(vp: VllmProcess, mode: str) -> int | None:
    """A warm pod: the warm-up token (then the marker goes), vLLM's LOAD result, to sleep if so
    asked, engine `ready`, the claim (vLLM still supervised), awake again, `ready`. None once in
    service; the exit code when vLLM failed or died on the way."""
    if (code := _timed_call(vp, "warm_up_token_s", vp.http.one_token,
                            "warm-up token through vLLM's OpenAI API")) is not None:
        return code
    vp.proven()
    report_load(vp)
    if mode == SLEEPING and (code := _timed_call(vp, "sleep_s", lambda: vp.http.sleep(level=1),
                                                 "vLLM sleep mode (POST /sleep?level=1)")) is not None:
        return code
    vp.mark("engine_ready_s", vp.started)
    vp.say(handoff.engine_ready, mode=mode, restored=vp.restored, engine_ready_s=vp.stages["engine_ready_s"])
    log.info("Warm engine %s (%s), waiting for the claim: %s", READY, mode, vp.stages)
    t = time.monotonic()
    claim = _claimed(vp)
    if claim is None:
        return _failed(vp, f"vllm serve exited {vp.code} while warm")
    vp.mark("warm_wait_s", t)
    claimed_at = claim.claimed_at or time.time()
    if mode == SLEEPING and (code := _timed_call(vp, "wake_up_s", vp.http.wake_up,
                                                 "vLLM wake-up (POST /wake_up) after the claim")) is not None:
        return code
    report_ready(vp, time.time() - claimed_at, claimed_at=claimed_at, mode=mode)
    return None


def _timed_call(vp: VllmProcess, stage: str, call: Callable[[], Any], what: str) -> int | None:
    """One call to vLLM, timed as `stage`; the exit code (engine failed) when it fails."""
    t = time.monotonic()
    try:
        call()
    except HTTP_ERRORS as exc:
        return _failed(vp, f"{what} failed: {exc}")
    vp.mark(stage, t)
    return None


def _claimed(vp: VllmProcess) -> handoff.InService | None:
    """Wait for the claim while vLLM lives; None when it exited first."""
    while vp.alive:
        claim = handoff.wait_for_claim(vp.handoff_dir, timeout=0.5)
        if claim is not None:
            return claim
    return None


def report_load(vp: VllmProcess) -> None:
    """vLLM's LOAD to the sidecar, from the plugin's report: `load` ok when it restored the graphs,
    else `load` fallback with the plugin's reason (the sidecar records the fallback, and a restart
    of the engine captures natively). Nothing when no archive was handed off (the fallback is
    reported already)."""
    if vp.result is None or vp.result.archive_dir is None:
        return
    report = vp.plugin_report()
    # one GPU: the report's own stages; a world of ranks: each rank's file
    each = list((report.get("ranks") or {}).values()) or [report]
    stages = [one.get("stages") or {} for one in each]
    if reports.ranks_restored(report):
        seconds = max(float((st.get("load") or st.get("capture") or {}).get("seconds") or 0.0)
                      for st in stages)
        handoff.report("load", seconds, "ok", run_dir=vp.handoff_dir, engine="vllm",
                       graphs=(stages[0].get("load") or {}).get("graphs"), ranks=len(each))
        return
    handoff.report("load", 0.0, "fallback", _not_restored(report, stages), run_dir=vp.handoff_dir,
                   engine="vllm")


def _not_restored(report: dict[str, Any], stages: list[dict[str, Any]]) -> str:
    """Why vLLM did not restore, from the plugin's stages (the front end's and every rank's); on
    N ranks: which ranks restored, and the first refusing rank's reason."""
    ranks = report.get("ranks") or {}
    if ranks:
        restored = sorted(int(r) for r, one in ranks.items() if reports.ranks_restored(one))
        world = max([int(one.get("world") or 0) for one in ranks.values()] + [len(ranks)])
        found = [(r, str(reason)) for r, one in sorted(ranks.items(), key=lambda kv: int(kv[0]))
                 for name in ("refused", "load_refused")
                 if (reason := ((one.get("stages") or {}).get(name) or {}).get("reason"))]
        # a canary's refusal: the rank that saw the difference, not one that heard of it; its
        # reason names the rank and keeps its head ("canary differs": the metric's class)
        own = [f for f in found if PEER_CANARY not in f[1]] or found
        if own:
            r, reason = own[0]
            where = "" if reason.startswith(CANARY_HEAD) else f"rank {r}: "
            return f"{where}{reason} (restored on {len(restored)} of {world} ranks)"
        if len(ranks) < world:
            return f"vllm-report-missing: {len(ranks)} of {world} ranks reported (restored on {restored})"
    for st in [report.get("stages") or {}, *stages]:
        for name in ("load_refused", "refused"):
            if reason := (st.get(name) or {}).get("reason"):
                return str(reason)
    hows = sorted({str((st.get("capture") or {}).get("how")) for st in stages if st.get("capture")})
    if hows:
        return f"vllm-captured: vLLM captured its graphs ({', '.join(hows)}), no reason given"
    return "vllm-report-missing: ember's vLLM plugin reported no capture (is it installed?)"


def report_ready(vp: VllmProcess, seconds: float, *, claimed_at: float, mode: str) -> None:
    """`ready` to the sidecar: `seconds` from the claim (a warm pod) or from vLLM's start (a cold
    one), the stages, and vLLM's own stage report (restored or why not) when it wrote one."""
    if claimed_at:
        vp.stages["claim_to_ready_s"] = round(max(0.0, time.time() - claimed_at), 4)
    extra: dict[str, Any] = {"engine": "vllm", "restored": vp.restored, "warm_engine": mode,
                             "stages": dict(vp.stages)}
    if plugin := vp.plugin_report():
        extra["vllm"] = plugin
    handoff.report("ready", seconds, run_dir=vp.handoff_dir, **extra)
    log.info("vLLM ready (%s, restored %s): %s", mode, vp.restored, vp.stages)
