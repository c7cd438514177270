"""Prometheus metrics of the operator (names listed in docs/operator.md), served on the metrics port.

Counters and histograms count what this process did (only the leader reconciles, so a standby's
stay at zero). Gauges of the cluster's state (warm pods, pods serving natively) are kept in
`STATE` and exported only while this replica leads: a standby, or a leader that lost its Lease,
exports none of them instead of the values it saw last. `ember_operator_leader` says which
replica leads (1) and is exported by every replica.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.contract import FALLBACK_PREFIX, reason_class

_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

RECONCILE_SECONDS = Histogram(
    "ember_reconcile_seconds", "Duration of one reconcile.", ["kind"], buckets=_FAST,
)
RECONCILE_ERRORS = Counter("ember_reconcile_errors_total", "Reconciles that raised.", ["kind"])
SAVE_SECONDS = Histogram(
    "ember_save_seconds", "SAVE Job duration, creation to archive available or failure.",
    buckets=(10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
)
SAVES_TOTAL = Counter("ember_saves_total", "SAVE outcomes.", ["result"])
_CLAIM = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
          5.0)
CLAIM_SECONDS = Histogram(
    "ember_claim_seconds", "Warm pod claim latency: reconcile start to claim patch accepted.",
    buckets=_CLAIM,
)
CLAIM_PATCH_SECONDS = Histogram(
    "ember_claim_patch_seconds", "One claim's API round trip (conditional label/annotation patch).",
    buckets=_CLAIM,
)
CLAIMS_TOTAL = Counter("ember_claims_total", "Warm pod claims.", ["result"])
COLD_PODS_TOTAL = Counter("ember_cold_pods_total", "Serving pods created cold (no warm pod to claim).")
# Children known in advance start at 0, so the first increment is an increase() alerts can see.
for _result in ("succeeded", "failed"):
    SAVES_TOTAL.labels(_result)
for _result in ("claimed", "lost"):
    CLAIMS_TOTAL.labels(_result)
for _kind in ("ModelDeployment", "GraphArchive"):
    RECONCILE_ERRORS.labels(_kind)
RESTORE_FALLBACKS_TOTAL = Counter(
    "ember_restore_fallbacks_total",
    "Serving pods seen falling back to native capture, by reason class (counted once per pod).",
    ["namespace", "deployment", "reason"],
)


@dataclass(frozen=True)
class Archive:
    """What the gauges say of one GraphArchive: its phase, stored bytes, and when its running SAVE
    started and when its Job's activeDeadlineSeconds ends it (Unix times; None when not Saving)."""

    phase: str = ""
    bytes: int | None = None
    save_started: float | None = None
    save_deadline: float | None = None


class State(Collector):
    """The operator's state gauges, exported only while `leading()` says this replica leads."""

    def __init__(self) -> None:
        self.leading: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        self._warm: dict[str, dict[str, int]] = {}  # namespace → pool → unclaimed pods
        self._warm_failures: dict[str, dict[str, int]] = {}  # namespace → pool → failures in a row
        # (ns, md) → (fallback, native, warm ready, warm loading)
        self._pods: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self._counted: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (ns, md) → counted pods
        self._archives: dict[tuple[str, str], Archive] = {}

    def set_warm_pools(self, namespace: str, sizes: dict[str, int]) -> None:
        """The namespace's pools, all of them: a pool no longer listed is no longer exported."""
        with self._lock:
            self._warm[namespace] = dict(sizes)

    def set_warm_failures(self, namespace: str, failures: dict[str, int]) -> None:
        """The namespace's failing pools (failures in a row); a pool not listed has none."""
        with self._lock:
            self._warm_failures[namespace] = dict(failures)

    def set_deployment(
        self, namespace: str, name: str, *, fallback: int, native: int, warm_ready: int = 0,
        warm_loading: int = 0,
    ) -> None:
        with self._lock:
            self._pods[(namespace, name)] = (fallback, native, warm_ready, warm_loading)

    def forget_deployment(self, namespace: str, name: str) -> None:
        with self._lock:
            self._pods.pop((namespace, name), None)
            self._counted.pop((namespace, name), None)

    def set_archive(self, namespace: str, name: str, archive: Archive) -> None:
        with self._lock:
            self._archives[(namespace, name)] = archive

    def forget_archive(self, namespace: str, name: str) -> None:
        with self._lock:
            self._archives.pop((namespace, name), None)

    def count_fallbacks(self, namespace: str, name: str, pods: Iterable[tuple[str, str, str]]) -> None:
        """Count each of the deployment's fallen-back pods (name, creation time, restore result)
        once: those not seen on the previous call are new fallbacks."""
        now = {(pod, created): restore for pod, created, restore in pods}
        with self._lock:
            before = self._counted.get((namespace, name), set())
            self._counted[(namespace, name)] = set(now)
        for key in now.keys() - before:
            reason = reason_class(now[key].removeprefix(FALLBACK_PREFIX))
            RESTORE_FALLBACKS_TOTAL.labels(namespace, name, reason).inc()

    def clear(self) -> None:
        with self._lock:
            self._warm.clear()
            self._warm_failures.clear()
            self._pods.clear()
            self._archives.clear()

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []  # the families depend on leadership: collected on every scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leading = self.leading()
        leader = GaugeMetricFamily("ember_operator_leader", "1 on the replica that holds the Lease and "
                                   "reconciles, 0 on a standby.")
        leader.add_metric([], 1.0 if leading else 0.0)
        yield leader
        if not leading:
            return
        warm = GaugeMetricFamily("ember_warm_pods", "Unclaimed warm pods.", labels=["namespace", "pool"])
        failing = GaugeMetricFamily("ember_warm_pool_failures", "Warm pods of a pool that failed in a row "
                                    "(engine failed, exited or restarted; its replacements back off); 0 "
                                    "once an engine of the pool is ready.", labels=["namespace", "pool"])
        fallback = GaugeMetricFamily("ember_fallback_pods", "Serving pods whose restore fell back to "
                                     "native capture, now.", labels=["namespace", "deployment"])
        native = GaugeMetricFamily("ember_native_pods", "Serving pods claimed without an archive "
                                   "(native capture), now.", labels=["namespace", "deployment"])
        engines = GaugeMetricFamily("ember_warm_engines", "A deployment's identity-keyed warm pods by "
                                    "engine state (ready: claimable; loading).",
                                    labels=["namespace", "deployment", "engine"])
        phases = GaugeMetricFamily("ember_archive_phase", "1 for the GraphArchive's phase (Pending, "
                                   "Saving, Available, Failed).", labels=["namespace", "archive", "phase"])
        stored = GaugeMetricFamily("ember_archive_bytes", "Stored bytes of an Available GraphArchive's "
                                 "blobs.", labels=["namespace", "archive"])
        saving = GaugeMetricFamily("ember_save_started_timestamp_seconds", "Unix time the running "
                                   "SAVE Job of a Saving GraphArchive was created.",
                                   labels=["namespace", "archive"])
        deadline = GaugeMetricFamily("ember_save_deadline_timestamp_seconds", "Unix time the running "
                                     "SAVE Job's activeDeadlineSeconds ends it (a Saving GraphArchive past "
                                     "it is stuck).", labels=["namespace", "archive"])
        with self._lock:
            for (ns, ga), archive in sorted(self._archives.items()):
                if archive.phase:
                    phases.add_metric([ns, ga, archive.phase], 1.0)
                if archive.bytes is not None:
                    stored.add_metric([ns, ga], float(archive.bytes))
                if archive.save_started is not None:
                    saving.add_metric([ns, ga], archive.save_started)
                if archive.save_deadline is not None:
                    deadline.add_metric([ns, ga], archive.save_deadline)
            for ns, pools in sorted(self._warm.items()):
                for pool, size in sorted(pools.items()):
                    warm.add_metric([ns, pool], float(size))
            for ns, pools in sorted(self._warm_failures.items()):
                for pool, count in sorted(pools.items()):
                    failing.add_metric([ns, pool], float(count))
            for (ns, md), (fell_back, natives, ready, loading) in sorted(self._pods.items()):
                fallback.add_metric([ns, md], float(fell_back))
                native.add_metric([ns, md], float(natives))
                engines.add_metric([ns, md, "ready"], float(ready))
                engines.add_metric([ns, md, "loading"], float(loading))
        yield from (warm, failing, fallback, native, engines, phases, stored, saving, deadline)


STATE = State()
REGISTRY.register(STATE)


def serve(port: int, host: str = "0.0.0.0") -> None:
    if port > 0:
        start_http_server(port, addr=host)
