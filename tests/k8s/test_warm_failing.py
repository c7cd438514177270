"""A warm pool whose engine fails at every load backs off (operator `warm_backoff`), on the local
control plane: the sidecar's report `ember.dev/engine: failed: …` is played on every warm pod once
it is scheduled (`EngineStandIn` with a failed state). Checked: each replacement comes no sooner
than the back-off allows (3 s, 6 s, 12 s here), a Warning `WarmEngineFailing` with the reason is
posted on the deployment, the failures are exported (`ember_warm_pool_failures`), and a ready
engine resets the pool.
"""

from __future__ import annotations

import itertools
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Api, OperatorProcess, md_spec, operator_env, wait_for, write_test_archive
from support.cluster import LocalCluster, LocalMinio

from ember_testing.cluster import EngineStandIn

pytestmark = [pytest.mark.k8s, pytest.mark.s3]

BASE_S, MAX_S = 3, 12
REASON = "CUDA out of memory at load"


@pytest.fixture
def env(k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path) -> Iterator[Any]:
    backoff = {"EMBER_OPERATOR_WARM_BACKOFF_SECONDS": str(BASE_S),
               "EMBER_OPERATOR_WARM_BACKOFF_MAX_SECONDS": str(MAX_S)}
    with operator_env(k8s, minio, tmp_path, "warmfail", env=backoff) as env:
        yield env


def _failures(op: OperatorProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
    return max([float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line.startswith("ember_warm_pool_failures{")] or [0.0])


def _created(api: Api, seen: dict[str, float]) -> int:
    """Record the creation time of every warm pod of the deployment seen so far (uid → seconds)."""
    for pod in api.core.list_namespaced_pod(api.ns, label_selector="ember.dev/warm-for=qwen").items:
        seen.setdefault(pod.metadata.uid, pod.metadata.creation_timestamp.timestamp())
    return len(seen)


def test_a_warm_pool_that_keeps_failing_backs_off_and_a_ready_engine_resets_it(
    env: Any, k8s: LocalCluster, minio: LocalMinio,
) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=0, warmPool={"size": 1})
    write_test_archive(minio, prefix, spec)
    seen: dict[str, float] = {}
    with EngineStandIn(k8s.kubeconfig, api.ns, state=f"failed: {REASON}"):
        api.create_md("qwen", spec)
        # the first pod and three replacements: waits of 3, 6 and 12 s in between (21 s at least)
        wait_for(lambda: _created(api, seen) >= 4, "three replacements of the failing warm pod", op,
                 timeout=90, interval=0.1)
        assert _failures(op) >= 3
    births = sorted(seen.values())[:4]
    gaps = [b - a for a, b in itertools.pairwise(births)]
    # creationTimestamp has whole seconds: each gap at least the back-off less one second
    for gap, delay in zip(gaps, [BASE_S, 2 * BASE_S, MAX_S], strict=True):
        assert gap >= delay - 1, (gaps, "a replacement came sooner than the back-off allows")
    notes = [e.get("message") or e.get("note") or "" for e in api.events_for("qwen")
             if e.get("reason") == "WarmEngineFailing"]
    assert notes and all(REASON in n for n in notes), notes
    assert any("3 in a row" in n for n in notes), notes

    # The engine loads again (the OOM fixed): the next pod's ready engine resets the pool.
    with EngineStandIn(k8s.kubeconfig, api.ns):
        started = time.monotonic()
        wait_for(lambda: any((p.metadata.annotations or {}).get("ember.dev/engine") == "ready"
                             for p in api.pods("ember.dev/warm-for=qwen")),
                 "a ready warm pod after the back-off", op, timeout=MAX_S + 30)
        wait_for(lambda: _failures(op) == 0, "the pool's failures reset", op)
    assert time.monotonic() - started < MAX_S + 30
    assert op.proc is not None and op.proc.poll() is None
