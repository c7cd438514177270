"""Back-off of warm pools whose pods keep failing (`warm_backoff`): the delays, what counts as a
failure (once per pod), the wait before replacements, and the reset by a ready engine."""

from __future__ import annotations

from typing import Any

from ember import contract
from ember_operator.observed import PodView
from ember_operator.settings import Settings
from ember_operator.warm_backoff import WarmBackoff, failure_reason


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _pod(name: str, key: str = "k1", engine: str = "", created: str = "t0", **over: Any) -> PodView:
    labels = {contract.LABEL_POOL: contract.POOL_WARM, contract.LABEL_POOL_KEY: key}
    return PodView(name=name, labels=labels, annotations={contract.ANN_ENGINE: engine} if engine else {},
                   created=created, **over)


def _backoff() -> tuple[WarmBackoff, Clock]:
    clock = Clock()
    return WarmBackoff(10.0, 300.0, clock), clock


def test_delays_double_from_the_base_and_stop_at_the_cap() -> None:
    b, _ = _backoff()
    assert [b.delay(n) for n in range(7)] == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0]
    assert b.delay(500) == 300.0
    assert WarmBackoff(0.0, 300.0).delay(3) == 0.0


def test_the_defaults_are_10s_to_5min() -> None:
    s = Settings.from_env({})
    assert (s.warm_backoff_seconds, s.warm_backoff_max_seconds) == (10.0, 300.0)
    s = Settings.from_env({"EMBER_OPERATOR_WARM_BACKOFF_SECONDS": "2",
                           "EMBER_OPERATOR_WARM_BACKOFF_MAX_SECONDS": "8"})
    assert (s.warm_backoff_seconds, s.warm_backoff_max_seconds) == (2.0, 8.0)


def test_failure_reasons() -> None:
    assert failure_reason(_pod("a", engine="failed: CUDA out of memory")) == "CUDA out of memory"
    assert failure_reason(_pod("a", engine="failed")) == "engine failed"
    assert failure_reason(_pod("a", engine_restarts=2)) == "engine container restarted (2×)"
    assert failure_reason(_pod("a", engine_exited=True)) == "engine container exited"
    assert failure_reason(_pod("a", phase="Failed")) == "pod Failed"
    assert failure_reason(_pod("a", engine="loading")) == ""
    assert failure_reason(_pod("a", engine="ready")) == ""


def test_each_dead_pod_counts_once_and_the_wait_grows() -> None:
    b, clock = _backoff()
    assert b.observe("ns", [_pod("a", engine="loading")]) == []
    assert b.wait("ns", "k1") == 0.0
    first = b.observe("ns", [_pod("a", engine="failed: OOM")])
    assert [(f.pod, f.reason, f.count, f.delay_s) for f in first] == [("a", "OOM", 1, 10.0)]
    assert b.observe("ns", [_pod("a", engine="failed: OOM")]) == []  # seen again (deletion pending)
    assert b.wait("ns", "k1") == 10.0
    clock.t += 4
    assert b.wait("ns", "k1") == 6.0
    clock.t += 6
    assert b.wait("ns", "k1") == 0.0
    # the replacement reuses the name (lowest free) but is another pod: a second failure
    second = b.observe("ns", [_pod("a", engine="failed: OOM", created="t1")])
    assert [(f.count, f.delay_s) for f in second] == [(2, 20.0)]
    assert b.wait("ns", "k1") == 20.0
    assert b.failures("ns") == {"k1": 2}
    assert b.wait("ns", "other") == 0.0 and b.wait("other-ns", "k1") == 0.0


def test_a_ready_engine_in_the_pool_resets_it_others_keep_theirs() -> None:
    b, _ = _backoff()
    b.observe("ns", [_pod("a", engine="failed: OOM"), _pod("b", key="k2", engine="failed: OOM")])
    assert b.failures("ns") == {"k1": 1, "k2": 1}
    b.observe("ns", [_pod("c", engine="ready")])
    assert b.failures("ns") == {"k2": 1}
    assert b.wait("ns", "k1") == 0.0 and b.wait("ns", "k2") == 10.0
    # one failure after the reset starts over from the base delay
    assert [f.delay_s for f in b.observe("ns", [_pod("d", engine="failed: x")])] == [10.0]


def test_pools_nobody_asks_for_are_forgotten() -> None:
    b, _ = _backoff()
    b.observe("ns", [_pod("a", engine="failed: x"), _pod("b", key="k2", engine="failed: x")])
    b.observe("ns2", [_pod("a", engine="failed: x")])
    b.forget("ns", {"k2"})
    assert b.failures("ns") == {"k2": 1} and b.failures("ns2") == {"k1": 1}
