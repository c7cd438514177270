"""Prometheus metrics of the operator (names listed in docs/operator.md), served on the metrics port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
WARM_PODS = Gauge("ember_warm_pods", "Unclaimed warm pods.", ["namespace", "pool"])
RESTORE_FALLBACKS = Gauge(
    "ember_restore_fallbacks", "Serving pods that fell back to native capture.", ["namespace", "deployment"],
)


def serve(port: int, host: str = "0.0.0.0") -> None:
    if port > 0:
        start_http_server(port, addr=host)
