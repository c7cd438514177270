"""Start-up of a serving engine, by the pod protocol (`ember.handoff`): wait for the sidecar's
archive up to a deadline → LOAD it inside the crash-safety marker (stages `compat`, `load`) → on
any refusal, report the fallback with its reason and capture natively (`capture`) → one token
(`first_token`) → only then `ready`. The engine's state (`engine-state.json`: loading, ready,
failed) goes to the sidecar as it changes. On an identity-keyed warm pod (the archive handed off
before any claim) the engine does all of that at once, then waits idle for the claim, which puts
it in service at once: no engine step between the claim and the client's first request (its
warm-up token already ran), and `first_token` is the claim → in service time. A claim whose
engine arguments are not the ones the engine was started with (`EngineStarters.claim_problem`: a
pod claimed for another deployment) fails the engine (`failed`) before anything is loaded: it
never serves.

The sequence only sees `EngineStarters` (restore / native / first token), so it is tested on CPU
with a fake engine; `cb_starters` puts the real transformers engine behind it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember import handoff
from ember.runtime.adapter import Refused

log = logging.getLogger("ember.serving")

@dataclass
class StartupResult:
    mode: str = "starting"  # starting | restored | native | failed
    reason: str = ""  # why native; empty when restored
    stages: dict[str, float] = field(default_factory=dict)
    graphs: int = 0
    identity: str = ""


def _any_claim(engine_args: tuple[str, ...]) -> str:
    return ""


class ClaimRefused(RuntimeError):
    """The claim's engine arguments are not the ones this engine was started with."""


@dataclass
class EngineStarters:
    """`restore(archive_dir)` → (facts, seconds per stage, "compat"/"load" among them), raising
    Refused or anything else to refuse; `native()` → (facts, capture seconds);
    `first_token()` runs one token through the started engine; `claim_problem(engine_args)` →
    why the engine cannot serve a claim with those arguments ("" when it can)."""

    restore: Callable[[Path], tuple[dict[str, Any], dict[str, float]]]
    native: Callable[[], tuple[dict[str, Any], float]]
    first_token: Callable[[], list[int]]
    claim_problem: Callable[[tuple[str, ...]], str] = _any_claim


def run_startup(
    starters: EngineStarters,
    *,
    run_dir: str | Path | None = None,
    use_handoff: bool = True,
    archive: Path | None = None,
    deadline: float | None = 30.0,
    claim_timeout: float | None = None,
) -> StartupResult:
    """Wait → LOAD or capture → first token → ready. Never raises for a refused archive."""
    out = StartupResult()
    t0 = time.time()
    result: handoff.HandoffResult | None = None
    archive_dir: Path | None = archive
    if archive is None and use_handoff:
        handoff.report("standby", 0.0, "ok", run_dir=run_dir)
        result = handoff.wait_for_archive(run_dir, deadline, claim_timeout=claim_timeout)
        archive_dir, out.identity, out.reason = result.archive_dir, result.identity, result.reason
        t0 = max(t0, result.claimed_at)  # a warm pod's clock starts at the claim, not at process start
    elif archive is None:
        out.reason = "handoff disabled"

    warm = result is not None and result.warm  # identity-keyed warm pod: the claim comes later
    _say(handoff.engine_loading, result, run_dir)
    try:
        _start(starters, out, result, archive_dir, run_dir, t0)
    except Exception as exc:  # the operator replaces a warm pod whose engine failed
        _say(handoff.engine_failed, result, run_dir, f"{type(exc).__name__}: {exc}")
        raise
    _say(handoff.engine_ready, result, run_dir, mode=out.mode)
    if warm:  # loaded, restored or captured, one token run: idle until the claim puts it in service
        claim = handoff.wait_for_claim(run_dir)
        assert claim is not None  # no timeout: a warm pod waits as long as it takes
        out.stages["warm_wait"] = claim.waited_s
        # In service now; a token run here would hold the client's first request for its length.
        out.stages["first_token"] = time.time() - (claim.claimed_at or time.time())
    handoff.report("first_token", out.stages["first_token"], "ok", run_dir=run_dir, mode=out.mode)
    handoff.report("ready", out.stages["first_token"], "ok", out.reason, run_dir=run_dir, mode=out.mode)
    log.info("Engine became ready: mode=%s reason=%r stages=%s", out.mode, out.reason, out.stages)
    return out


def _say(state: Callable[..., Any], result: handoff.HandoffResult | None, run_dir: str | Path | None,
         *reason: str, **info: Any) -> None:
    """The engine's state to the sidecar (`engine-state.json`), for the hand-off's claim."""
    if result is not None:
        state(*reason, result, **info)
    else:
        state(*reason, None, run_dir=run_dir, **info)


def _start(starters: EngineStarters, out: StartupResult, result: handoff.HandoffResult | None,
           archive_dir: Path | None, run_dir: str | Path | None, t0: float) -> None:
    """LOAD (else native capture) and one token, for a claim this engine can serve."""
    if result is not None and (problem := starters.claim_problem(result.engine_args)):
        raise ClaimRefused(problem)
    # A process death from here to the first token leaves the crash marker: the next start in the
    # pod captures natively instead of loading again (ember.handoff.wait_for_archive).
    attempt = handoff.load_attempt(result).begin() if archive_dir is not None and result is not None else None
    if archive_dir is not None and _restore(starters, archive_dir, run_dir, out):
        out.mode = "restored"
        _first_token(starters, out, t0)  # an exception here keeps the marker: restored graphs failed
    if attempt is not None:
        attempt.done()
    if out.mode != "restored":
        _start_native(starters, out, run_dir)
        _first_token(starters, out, t0)


def _start_native(starters: EngineStarters, out: StartupResult, run_dir: str | Path | None) -> None:
    """Native capture (the engine's own start-up); reports `capture`."""
    t = time.monotonic()
    try:
        facts, seconds = starters.native()
    except Exception as exc:
        out.mode, out.reason = "failed", f"native start failed: {exc}"
        handoff.report("capture", time.monotonic() - t, "failed", out.reason, run_dir=run_dir)
        raise
    out.stages["capture"], out.graphs, out.mode = seconds, int(facts.get("graphs", 0)), "native"
    handoff.report("capture", seconds, "ok", out.reason, run_dir=run_dir)


def _first_token(starters: EngineStarters, out: StartupResult, t0: float) -> None:
    t = time.monotonic()
    starters.first_token()
    out.stages["first_token_run"] = time.monotonic() - t
    out.stages["first_token"] = time.time() - t0


def _restore(
    starters: EngineStarters, archive_dir: Path, run_dir: str | Path | None, out: StartupResult
) -> bool:
    t = time.monotonic()
    try:
        facts, seconds = starters.restore(archive_dir)
    except Exception as exc:
        stage = exc.stage if isinstance(exc, Refused) else "load"
        out.reason = str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}"
        handoff.report(stage, time.monotonic() - t, "fallback", out.reason, run_dir=run_dir)
        log.warning("Archive refused at %s, capturing natively: %s", stage, out.reason)
        return False
    for stage in ("compat", "load"):
        if stage in seconds:
            out.stages[stage] = seconds[stage]
            handoff.report(stage, seconds[stage], "ok", run_dir=run_dir)
    out.graphs = int(facts.get("graphs", 0))
    return True



# ---------------------------------------------------------------------------------------------
# The real engine behind the seams
# ---------------------------------------------------------------------------------------------


def cb_starters(engine: Any, sizing_overrides: dict[str, Any],
                claim_problem: Callable[[tuple[str, ...]], str] = _any_claim) -> EngineStarters:
    """EngineStarters over a CBEngine (imports torch/transformers lazily)."""
    from ember.engines.transformers_cb.adapter import restore_into

    def restore(archive_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
        info = restore_into(engine, archive_dir)
        return {"graphs": info.graphs}, info.seconds

    def native() -> tuple[dict[str, Any], float]:
        info = engine.start_native(**sizing_overrides)
        return {"graphs": info.graphs}, sum(info.seconds.values())

    def first_token() -> list[int]:
        return engine.generate(FIRST_TOKEN_PROMPT, max_new_tokens=1)

    return EngineStarters(restore, native, first_token, claim_problem)


FIRST_TOKEN_PROMPT = list(range(11, 27))

