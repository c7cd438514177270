"""Prometheus metrics of the sidecar, on a registry of its own (served at /metrics).

`ember_restore_stage_seconds{stage}`: claim_to_fetch, fetch, verify, handoff (sidecar side);
compat, load, capture, first_token (reported by the engine through ember.handoff).
`ember_restores_total{result, reason}`: result restored|fallback, reason the fallback class
(`digest-mismatch`, `identity-mismatch`, `store-unavailable`, `compat-mismatch`, ...), "" when
restored. `ember_prefetches_total{result}`: warm-pod prefetches (ok|failed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGES = ("claim_to_fetch", "fetch", "verify", "handoff", "compat", "load", "capture", "first_token")
# Restore stages span sub-millisecond cache hits to minute-long native captures.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The sidecar's metric families; one instance per process (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.stage_seconds = Histogram(
            "ember_restore_stage_seconds", "Seconds spent in each restore stage",
            ["stage"], buckets=BUCKETS, registry=self.registry,
        )
        self.restores = Counter(
            "ember_restores_total", "Restores by result (restored|fallback) and fallback reason",
            ["result", "reason"], registry=self.registry,
        )
        self.prefetches = Counter(
            "ember_prefetches_total", "Warm-pod archive prefetches by result", ["result"],
            registry=self.registry,
        )
        self.ready = Gauge("ember_sidecar_ready", "1 when /readyz passes", registry=self.registry)

    def observe(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(stage=stage).observe(max(0.0, float(seconds)))

    def restored(self) -> None:
        self.restores.labels(result="restored", reason="").inc()

    def fallback(self, reason_class: str) -> None:
        self.restores.labels(result="fallback", reason=reason_class).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
