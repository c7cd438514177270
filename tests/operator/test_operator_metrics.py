"""The operator's metrics: state gauges only from the leader, fallbacks counted once per pod."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from ember_operator import metrics
from ember_operator.metrics import State


def _registry(state: State) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(state)
    return registry


def _fallbacks(ns: str, md: str, reason: str) -> float:
    return REGISTRY.get_sample_value(
        "ember_restore_fallbacks_total", {"namespace": ns, "deployment": md, "reason": reason}) or 0.0


def test_standby_exports_no_state_gauges() -> None:
    leading = [True]
    state = State()
    state.leading = lambda: leading[0]
    state.set_warm_pools("ns", {"pool-a": 3})
    state.set_deployment("ns", "md", fallback=2, native=1)
    reg = _registry(state)
    assert reg.get_sample_value("ember_operator_leader") == 1.0
    assert reg.get_sample_value("ember_warm_pods", {"namespace": "ns", "pool": "pool-a"}) == 3.0
    assert reg.get_sample_value("ember_fallback_pods", {"namespace": "ns", "deployment": "md"}) == 2.0
    assert reg.get_sample_value("ember_native_pods", {"namespace": "ns", "deployment": "md"}) == 1.0

    leading[0] = False  # lost the Lease: the last values it saw are not exported
    assert reg.get_sample_value("ember_operator_leader") == 0.0
    assert reg.get_sample_value("ember_warm_pods", {"namespace": "ns", "pool": "pool-a"}) is None
    assert reg.get_sample_value("ember_fallback_pods", {"namespace": "ns", "deployment": "md"}) is None


def test_pools_and_deployments_that_are_gone_are_not_exported() -> None:
    state = State()
    reg = _registry(state)
    state.set_warm_pools("ns", {"a": 1, "b": 2})
    state.set_warm_pools("ns", {"b": 0})
    state.set_warm_pools("other", {"a": 4})
    assert reg.get_sample_value("ember_warm_pods", {"namespace": "ns", "pool": "a"}) is None
    assert reg.get_sample_value("ember_warm_pods", {"namespace": "ns", "pool": "b"}) == 0.0
    assert reg.get_sample_value("ember_warm_pods", {"namespace": "other", "pool": "a"}) == 4.0
    state.set_deployment("ns", "md", fallback=1, native=0)
    state.forget_deployment("ns", "md")
    assert reg.get_sample_value("ember_fallback_pods", {"namespace": "ns", "deployment": "md"}) is None


def test_fallbacks_counted_once_per_pod_with_reason_class() -> None:
    state = State()
    ns, md = "ns-count", "md-count"
    before = _fallbacks(ns, md, "digest-mismatch")
    pod = ("md-abc-0", "2026-11-27T10:00:00Z", "fallback: digest-mismatch: blob 12 is corrupt")
    state.count_fallbacks(ns, md, [pod])
    state.count_fallbacks(ns, md, [pod])  # the next reconcile sees the same pod
    assert _fallbacks(ns, md, "digest-mismatch") == before + 1
    # The same name, a new pod (recreated): a new fallback.
    again = ("md-abc-0", "2026-11-27T11:00:00Z", "fallback: compat-mismatch: driver 550 vs 560")
    state.count_fallbacks(ns, md, [again])
    assert _fallbacks(ns, md, "compat-mismatch") == 1
    assert _fallbacks(ns, md, "digest-mismatch") == before + 1


def test_module_state_is_registered_on_the_default_registry() -> None:
    names = {m.name for m in REGISTRY.collect()}
    assert {"ember_operator_leader", "ember_restore_fallbacks"} <= names  # counter family name
    assert metrics.STATE.leading()


def test_archive_gauges_follow_the_phase() -> None:
    state = State()
    reg = _registry(state)
    ga = {"namespace": "ns", "archive": "ga-1"}
    state.set_archive("ns", "ga-1", metrics.Archive("Saving", None, 1_700_000_000.0, 1_700_003_600.0))
    assert reg.get_sample_value("ember_archive_phase", {**ga, "phase": "Saving"}) == 1
    assert reg.get_sample_value("ember_save_started_timestamp_seconds", ga) == 1_700_000_000.0
    assert reg.get_sample_value("ember_save_deadline_timestamp_seconds", ga) == 1_700_003_600.0
    state.set_archive("ns", "ga-1", metrics.Archive("Available", 4_400_000, None))
    assert reg.get_sample_value("ember_archive_phase", {**ga, "phase": "Saving"}) is None
    assert reg.get_sample_value("ember_save_started_timestamp_seconds", ga) is None
    assert reg.get_sample_value("ember_archive_bytes", ga) == 4_400_000
    state.forget_archive("ns", "ga-1")
    assert reg.get_sample_value("ember_archive_bytes", ga) is None
