"""The restore state machine: claim → fetch → verify → handoff → engine reports → result.

`Restorer` is driven from outside (the pod watch or standalone start-up calls `on_annotations`,
`claim`, `stop`; a poller calls `poll_engine`) and talks to the world through the cache, the
handoff writer, the metrics and a Reporter. Every failure becomes a fallback: the handoff says
`fallback` (the engine captures natively), the pod gets `ember.dev/restore=fallback: <reason>`,
a Warning event goes to the pod and its ModelDeployment, and `ember_restores_total` counts it.
Nothing here raises to the caller or exits the process.

Identity-keyed warm pods carry the hand-off data from their creation: the sidecar fetches, verifies
and hands off at once (the handoff's `warm` flag set), the engine LOADs and says it is loaded and
idle (`engine-state.json`), and the sidecar mirrors that onto the pod (`ember.dev/engine`). The
claim changes only labels (pool warm → serving) and the claim stamp: the sidecar then clears the
`warm` flag (`HandoffWriter.in_service`) and the engine's `wait_for_claim` returns.

Readiness (served at /readyz): Ready when the engine has reported `ready` (a stage report or its
state file: it takes requests); an identity-keyed warm pod so too before its claim (its labels keep
it out of every Service until the claim flips them, so no probe period stands between the claim
and the first request), never while its engine says failed. Before any claim, a template-keyed
warm pod is Ready (= claimable by the pool) once the engine reported
`standby` (weights loaded, waiting for the archive), or at once with
EMBER_WARM_READY_WITHOUT_ENGINE=1. After a claim and before the engine's `ready`, not Ready, so a
Service never routes requests to a pod that is still restoring.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ember import contract
from ember.contract import FALLBACK_PREFIX, RESTORED, Claim, ClaimError
from ember.handoff import HandoffWriter
from ember.identity import identity_short
from ember_sidecar.claims import manifest_identity, parse_claim, parse_prefetch, reason_class
from ember_sidecar.fetching import ArchiveCache, Cancelled, FetchFailed
from ember_sidecar.metrics import STAGES, Metrics
from ember_sidecar.reporting import Reporter

log = logging.getLogger(__name__)

MAX_CLAIM_LAG_S = 60.0


@dataclass
class ClaimState:
    """What happened to the current claim (one at a time)."""

    claim: Claim
    observed_at: float
    handed_off_at: float | None = None
    result: str | None = None  # "restored" | "fallback: <reason>"
    loaded: set[str] = field(default_factory=set)  # ranks that reported LOAD ok (reports with a rank)


class Restorer:
    """One pod's restore logic. Thread-safe; every public method returns quickly or is a worker."""

    def __init__(
        self,
        cache: ArchiveCache,
        writer: HandoffWriter,
        metrics: Metrics,
        reporter: Reporter,
        *,
        engine_timeout_s: float = 600.0,
        warm_ready_without_engine: bool = False,
    ) -> None:
        self.cache, self.writer, self.metrics, self.reporter = cache, writer, metrics, reporter
        self.engine_timeout_s = engine_timeout_s
        self.warm_ready_without_engine = warm_ready_without_engine
        self.lock = threading.RLock()
        self.current: ClaimState | None = None
        self.engine_standby = False
        self.engine_ready = False
        self.engine = ""  # what ANN_ENGINE says (last reported): loading | ready | failed: ...
        self.draining = False  # the operator took the pod out of service (ANN_DRAIN)
        self.stopping = threading.Event()
        self._claim_cancel = threading.Event()
        self._prefetch_cancel: dict[str, threading.Event] = {}  # identity → its prefetch's cancel
        self._workers: list[threading.Thread] = []
        self._prefetched: set[str] = set()
        self._bad_claims: set[str] = set()
        if writer.status() is None:
            writer.unclaimed()

    # ---- inputs -------------------------------------------------------------------------------

    def on_annotations(
        self, annotations: dict[str, str] | None, observed_at: float | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        """A (new version of the) pod was seen: start a restore for a new claim (on an
        identity-keyed warm pod, whose `labels` say pool warm, before the claim), put a warm pod
        into service when its claim arrives, or prefetch."""
        observed_at = observed_at or time.time()
        warm = (labels or {}).get(contract.LABEL_POOL) == contract.POOL_WARM
        self.draining = bool((annotations or {}).get(contract.ANN_DRAIN))
        try:
            claim = parse_claim(annotations)
        except ClaimError as exc:
            key = str(exc)
            with self.lock:
                if key in self._bad_claims:
                    return
                self._bad_claims.add(key)
            reason = str(exc) if str(exc).startswith("identity-mismatch") else f"claim-invalid: {exc}"
            self._fallback(None, reason, identity=(annotations or {}).get(contract.ANN_IDENTITY, ""))
            return
        if claim is not None:
            if not self.claim(claim, observed_at, warm=warm) and not warm:
                self._into_service(claim, observed_at)
            return
        for uri in parse_prefetch(annotations):
            self.prefetch(uri)

    def claim(self, claim: Claim, observed_at: float | None = None, *, warm: bool = False) -> bool:
        """Start restoring `claim` unless it is the claim already handled. True when started.
        `warm`: the hand-off data of an identity-keyed warm pod, not yet a claim (the handoff says
        `warm` until `_into_service`)."""
        observed_at = observed_at or time.time()
        with self.lock:
            if self.stopping.is_set() or (self.current is not None and self.current.claim.key == claim.key):
                return False
            if self.current is not None:
                log.info("Claim changed from %s to %s", identity_short(self.current.claim.identity),
                         identity_short(claim.identity))
                self._claim_cancel.set()
                self._claim_cancel = threading.Event()
            # A claim's fetch gets the bandwidth; a prefetch of the claimed archive goes on (the
            # claim waits for it on the archive's lock and then finds it cached).
            for identity, ev in self._prefetch_cancel.items():
                if identity != claim.identity:
                    ev.set()
            state = ClaimState(claim, observed_at)
            self.current = state
            self.engine_ready = False
            self.writer.warm = warm
            cancel = self._claim_cancel
            self.writer.fetching(claim.identity, claim.archive_uri, self._claim_time(claim, observed_at))
        log.info("%s: archive %s identity %s", "Warm pod's archive" if warm else "Claim observed",
                 claim.archive_uri, identity_short(claim.identity))
        self._start(self._restore, state, cancel, name="ember-restore")
        return True

    def _into_service(self, claim: Claim, observed_at: float) -> None:
        """The claim of a warm pod whose archive is already handled: into service, once."""
        with self.lock:
            if not self.writer.warm or self.current is None or self.current.claim.key != claim.key:
                return
            self.writer.in_service(self._claim_time(claim, observed_at))
        log.info("Claimed: warm pod of %s in service", identity_short(claim.identity))

    def prefetch(self, archive_uri: str) -> None:
        """Warm pod: cache an archive before any claim (failures are only logged and counted)."""
        with self.lock:
            if archive_uri in self._prefetched or self.current is not None or self.stopping.is_set():
                return
            self._prefetched.add(archive_uri)
            cancel = self._prefetch_cancel.setdefault(manifest_identity(archive_uri) or archive_uri,
                                                      threading.Event())
        self._start(self._prefetch, archive_uri, cancel, name="ember-prefetch")

    def stop(self, wait_s: float = 2.0) -> int:
        """Cancel fetches, wait a little for workers, remove partial files. Returns files removed."""
        self.stopping.set()
        self._claim_cancel.set()
        for ev in list(self._prefetch_cancel.values()):
            ev.set()
        deadline = time.monotonic() + wait_s
        for t in list(self._workers):
            t.join(max(0.0, deadline - time.monotonic()))
        return self.cache.clean_partials()

    # ---- workers ------------------------------------------------------------------------------

    def _start(self, fn: Any, *args: Any, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        self._workers = [w for w in self._workers if w.is_alive()] + [t]
        t.start()

    def _restore(self, state: ClaimState, cancel: threading.Event) -> None:
        claim = state.claim
        started = time.time()
        self.metrics.observe("claim_to_fetch", started - self._claim_time(claim, state.observed_at))
        try:
            fetched = self.cache.fetch(claim.archive_uri, claim.identity, cancel, claim.manifest_digest)
        except Cancelled:
            log.info("Restore of %s cancelled", identity_short(claim.identity))
            return
        except FetchFailed as exc:
            self._fallback(state, exc.reason)
            return
        except Exception as exc:  # a bug must still end in a fallback, not a dead sidecar
            log.exception("Restore of %s failed unexpectedly", identity_short(claim.identity))
            self._fallback(state, f"sidecar-error: {type(exc).__name__}: {exc}")
            return
        if cancel.is_set():
            return
        self.metrics.observe("fetch", fetched.fetch_s)
        self.metrics.observe("verify", fetched.verify_s)
        with self.lock:
            if self.current is not state:
                return
            self.writer.ready(claim.identity, fetched.archive_dir, claim.archive_uri, claim.rank, claim.world,
                              claim.engine_args)
            state.handed_off_at = time.time()
        log.info(
            "Archive %s handed off (%s, %.1f MB, fetch %.3fs, verify %.3fs, claim→handoff %.3fs)",
            identity_short(claim.identity), "cached" if fetched.cached else "fetched",
            fetched.bytes_fetched / 1e6,
            fetched.fetch_s, fetched.verify_s, state.handed_off_at - state.observed_at,
        )

    @staticmethod
    def _claim_time(claim: Claim, observed_at: float) -> float:
        """The operator's claim stamp, unless it is from the future (clock skew) or stale (a
        restarted sidecar re-observing an old claim): then the time the watch delivered it."""
        stamp = claim.claimed_at
        return stamp if stamp and 0 <= observed_at - stamp <= MAX_CLAIM_LAG_S else observed_at

    def _prefetch(self, archive_uri: str, cancel: threading.Event) -> None:
        identity = manifest_identity(archive_uri) or ""
        try:
            fetched = self.cache.fetch(archive_uri, identity, cancel)
        except Cancelled:
            return
        except FetchFailed as exc:
            self.metrics.prefetches.labels(result="failed").inc()
            log.warning("Prefetch of %s failed: %s", archive_uri, exc.reason)
            with self.lock:
                self._prefetched.discard(archive_uri)  # a later pod update may retry it
            return
        self.metrics.prefetches.labels(result="ok").inc()
        log.info("Prefetched %s (%.1f MB in %.3fs)",
                 archive_uri, fetched.bytes_fetched / 1e6, fetched.fetch_s)

    # ---- results ------------------------------------------------------------------------------

    def _fallback(self, state: ClaimState | None, reason: str, identity: str = "") -> None:
        """Record a fallback once per claim: handoff, annotation, events, metric."""
        with self.lock:
            if state is not None:
                if self.current is not state or (state.result or "").startswith(FALLBACK_PREFIX):
                    return
                state.result = FALLBACK_PREFIX + reason
                identity = state.claim.identity
                archive = state.claim.archive_uri
                args = state.claim.engine_args
            else:
                archive, args = "", ()
            self.metrics.fallback(reason_class(reason))
            # Before handoff this tells the waiting engine to capture; after it, an engine that
            # restarts (e.g. after a compat mismatch or divergence) captures instead of re-LOADing.
            self.writer.fallback(reason, identity=identity, archive_uri=archive, engine_args=args)
        log.warning("Restore fell back to native capture: %s", reason)
        self.reporter.result(FALLBACK_PREFIX + reason)
        self.reporter.event("Warning", "RestoreFallback",
                            f"archive {identity_short(identity) or '?'}: falling back to native capture: "
                            f"{reason}",
                            deployment=True)

    def _restored(self, state: ClaimState, load_s: float) -> None:
        with self.lock:
            if state.result is not None:
                return
            state.result = RESTORED
        self.metrics.restored()
        self.reporter.result(RESTORED)
        self.reporter.event("Normal", "Restored",
                            f"archive {identity_short(state.claim.identity)} restored; LOAD {load_s:.3f}s")

    def poll_engine(self) -> None:
        """Turn new engine reports into metrics, results and readiness; enforce the engine timeout."""
        for entry in self.writer.new_reports():
            stage = str(entry.get("stage", ""))
            result = str(entry.get("result", "ok"))
            seconds = float(entry.get("seconds") or 0.0)
            reason = str(entry.get("reason") or "")
            if stage in STAGES:
                self.metrics.observe(stage, seconds)
            with self.lock:
                state = self.current
            if stage == "standby":
                self.engine_standby = True
            elif stage == "ready" and result == "ok":
                self.engine_ready = True
            if result in ("fallback", "failed") and stage not in ("standby", "ready"):
                self._fallback(state, reason or f"{stage}-failed")
            elif stage == "load" and result == "ok" and state is not None:
                # A report without a rank is the one engine process of the pod (ember serve, vLLM's
                # rank 0): the pod is restored. Engines that report ranks need every rank 0..world-1.
                if "rank" not in entry:
                    self._restored(state, seconds)
                else:
                    state.loaded.add(str(entry["rank"]))
                    if state.loaded >= {str(i) for i in range(max(1, state.claim.world))}:
                        self._restored(state, seconds)
        self._mirror_engine()
        with self.lock:
            state = self.current
        if (state is not None and state.handed_off_at is not None and state.result is None
                and time.time() - state.handed_off_at > self.engine_timeout_s):
            self._fallback(state, f"engine-timeout: no LOAD result {self.engine_timeout_s:g}s after handoff")

    def engine_value(self) -> str:
        """What ANN_ENGINE should say now: the engine's state file (for the current claim), else
        ready after its `ready` report, else loading once the archive (or a fallback) is handed
        over; "" before that."""
        with self.lock:
            state = self.current
        st = self.writer.engine_state()
        ours = st is not None and (state is None or st.get("identity", "") in ("", state.claim.identity))
        if st is not None and ours and (
                value := contract.engine_annotation(str(st.get("state", "")), str(st.get("reason") or ""))):
            return value
        if self.engine_ready:
            return contract.ENGINE_READY
        if state is not None and (state.handed_off_at is not None or state.result is not None):
            return contract.ENGINE_LOADING
        return ""

    def _mirror_engine(self) -> None:
        value = self.engine_value()
        if value == contract.ENGINE_READY:
            self.engine_ready = True
        elif value == contract.ENGINE_LOADING and self.engine == contract.ENGINE_READY:
            # The engine said ready and now says loading: its container restarted (a crash, an
            # OOM kill). Not ready until it says so again: no request goes to a loading engine.
            self.engine_ready = False
        if value and value != self.engine:
            self.engine = value
            log.info("Engine: %s", value)
            self.reporter.engine(value)

    def readiness(self) -> tuple[bool, str]:
        """(ready, why) for /readyz."""
        if self.stopping.is_set():
            return False, "stopping"
        if self.draining:
            return False, "draining: out of service, requests in flight finish"
        if self.engine.startswith(contract.ENGINE_FAILED_PREFIX):
            return False, f"engine {self.engine}"
        if self.engine_ready and self.writer.warm:
            return True, "warm: engine ready, out of service until claimed"
        if self.engine_ready:
            return True, "engine ready"
        with self.lock:
            claimed = self.current is not None
        if not claimed:
            if self.engine_standby:
                return True, "warm: engine on standby, claimable"
            if self.warm_ready_without_engine:
                return True, "warm: claimable"
            return False, "warm: engine not on standby yet"
        return False, "claimed: restore in progress"

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view for logs and the /status endpoint."""
        with self.lock:
            s = self.current
            return {
                "claim": None if s is None else {"archive": s.claim.archive_uri,
                                                 "identity": s.claim.identity},
                "handed_off": None if s is None else s.handed_off_at,
                "result": None if s is None else s.result,
                "engine_standby": self.engine_standby,
                "engine_ready": self.engine_ready,
                "engine": self.engine,
                "warm": self.writer.warm,
                "ready": self.readiness()[0],
            }
