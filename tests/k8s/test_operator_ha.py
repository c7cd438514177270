"""Operator HA on the real local control plane: a coordination.k8s.io Lease decides which replica
reconciles; a SIGKILLed leader is replaced within the lease duration; nothing is duplicated.

Also demo/test coexistence: two operators of different configuration on one cluster (the demo's
and a test's) do not fight over warm pods.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from operator_harness import Api, OperatorProcess, md_spec, phase, wait_for, write_test_archive
from support.cluster import LocalCluster, LocalMinio

from ember_operator.kube import Kube
from ember_operator.leader import LeaderElector

pytestmark = [pytest.mark.k8s, pytest.mark.s3, pytest.mark.slow]

LEASE = "ember-operator"
DURATION_S = 3.0
HA_ENV = {"EMBER_OPERATOR_STANDALONE": "false", "EMBER_OPERATOR_LEASE_DURATION_SECONDS": str(DURATION_S),
          "EMBER_OPERATOR_LEASE_RETRY_SECONDS": "0.5"}


def _holder(k8s: LocalCluster, ns: str) -> str:
    coord = client.CoordinationV1Api(k8s.api_client)
    try:
        return coord.read_namespaced_lease(LEASE, ns).spec.holder_identity or ""
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return ""
        raise


@pytest.fixture
def ns_api(k8s: LocalCluster, minio: LocalMinio, crds: None) -> Iterator[Api]:
    ns = k8s.create_namespace("ha")
    api = Api(k8s, ns)
    api.create_secret("ember-s3", minio)
    try:
        yield api
    finally:
        k8s.delete_namespace(ns)


def _operators(api: Api, tmp_path: Path, count: int, **env: str) -> list[OperatorProcess]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return [OperatorProcess(kubeconfig=api.k8s.kubeconfig, namespace=api.ns, log_path=tmp_path / f"op{i}.log",
                            env={**HA_ENV, **env}).start() for i in range(count)]


def _reconciled(op: OperatorProcess) -> bool:
    """Whether this process has acted on objects (its log names a reconcile step)."""
    text = op.log_path.read_text(errors="replace") if op.log_path.exists() else ""
    return any(word in text for word in ("ModelDeployment ", "GraphArchive "))


def test_lease_election_one_leader_takeover_and_release(k8s: LocalCluster, ns_api: Api) -> None:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(k8s.kubeconfig), client_configuration=cfg)
    kube = Kube(cfg)
    a = LeaderElector(kube, ns_api.ns, LEASE, "a", duration_s=1.5)
    b = LeaderElector(kube, ns_api.ns, LEASE, "b", duration_s=1.5)
    assert a.step() and not b.step()
    assert _holder(k8s, ns_api.ns) == "a"
    for _ in range(4):  # a renews; b keeps seeing a live holder
        time.sleep(0.4)
        assert a.step() and not b.step()
    # a stops renewing (as if SIGKILLed): b takes over once the Lease has not changed for 1.5 s
    started = time.monotonic()
    while not b.step():
        time.sleep(0.2)
    assert 1.3 < time.monotonic() - started < 3.0
    assert _holder(k8s, ns_api.ns) == "b"
    assert not a.step(), "the old leader must see the new holder and stand down"
    b.release()  # a clean stop: the next candidate takes over at once
    assert not b.step(), "a released candidate never takes the Lease again"
    assert a.step() and _holder(k8s, ns_api.ns) == "a"


def _metrics(op: OperatorProcess) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()


def test_two_replicas_one_reconciles_and_a_sigkill_hands_over(ns_api: Api, minio: LocalMinio,
                                                               tmp_path: Path) -> None:
    api = ns_api
    ops = _operators(api, tmp_path, 2)
    try:
        holder = wait_for(lambda: _holder(api.k8s, api.ns), "a Lease holder", ops[0])
        prefix = f"ha-{api.ns}"
        spec = md_spec(minio, prefix, replicas=2, warmPool={"size": 2})
        write_test_archive(minio, prefix, spec)
        api.create_md("qwen", spec)
        wait_for(lambda: phase(api, "qwen") == "Ready" and len(api.warm()) == 2, "Ready + 2 warm", ops[0])
        time.sleep(3)  # both replicas saw every event by now: nothing may be duplicated
        assert len(api.warm()) == 2 and len(api.serving("qwen")) == 2 and api.jobs() == []
        acting = [op for op in ops if _reconciled(op)]
        assert len(acting) == 1, "exactly one replica may reconcile: " + ops[1].log_tail(20)
        leader, standby = acting[0], next(op for op in ops if op is not acting[0])
        # State gauges come from the leader only: the standby exports none (no stale values).
        led, stood = _metrics(leader), _metrics(standby)
        assert "ember_operator_leader 1.0" in led and "ember_operator_leader 0.0" in stood
        assert f'ember_warm_pods{{namespace="{api.ns}"' in led and "ember_warm_pods{" not in stood
        assert 'phase="Available"} 1.0' in led and "ember_archive_phase{" not in stood

        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: _holder(api.k8s, api.ns) not in ("", holder), "the standby takes the Lease", standby,
                 timeout=DURATION_S + 5, interval=0.1)
        took = time.monotonic() - killed
        assert took < DURATION_S + 2, took
        api.patch_md("qwen", {"spec": {"replicas": 3}})
        wait_for(lambda: len(api.serving("qwen")) == 3 and phase(api, "qwen") == "Ready", "3 Ready", standby)
        # the claimed warm pod is replaced by the pool's own pass, which may come after the claim's
        wait_for(lambda: len(api.warm()) == 2, "the pool topped up to 2", standby, timeout=30)
        time.sleep(2)
        assert len(api.warm()) == 2, "the new leader must top the pool up to its size, not past it"
        assert "ember_operator_leader 1.0" in _metrics(standby)
        print(f"standby took the Lease {took:.1f} s after the leader's SIGKILL")
    finally:
        for op in ops:
            op.stop()


def test_a_stopped_leader_hands_over_at_once(ns_api: Api, tmp_path: Path) -> None:
    """SIGTERM (a rolling update): the leader releases the Lease on its way out and does not take
    it back, so the standby leads at its next try instead of after the lease duration."""
    api = ns_api
    first = _operators(api, tmp_path / "a", 1, EMBER_OPERATOR_LEASE_DURATION_SECONDS="30")[0]
    try:
        held = wait_for(lambda: _holder(api.k8s, api.ns), "the first replica leads", first)
        second = _operators(api, tmp_path / "b", 1, EMBER_OPERATOR_LEASE_DURATION_SECONDS="30")[0]
        try:
            time.sleep(2)
            assert _holder(api.k8s, api.ns) == held
            stopped = time.monotonic()
            first.stop()
            wait_for(lambda: _holder(api.k8s, api.ns) not in ("", held), "the second replica leads", second,
                     timeout=10, interval=0.1)
            assert time.monotonic() - stopped < 10, "taken over on release, not after the 30 s duration"
        finally:
            second.stop()
    finally:
        first.stop()


def test_two_operators_of_different_config_do_not_fight(
    ns_api: Api, minio: LocalMinio, tmp_path: Path,
) -> None:
    """Two operators with different sidecar images are candidates of one Lease: only the holder
    acts, so for 15 s the pool stays at its size (3 warm pods, never replaced, one sidecar image)."""
    api = ns_api
    ops = [_operators(api, tmp_path / "a", 1, EMBER_OPERATOR_SIDECAR_IMAGE="registry.invalid/ember/a:1")[0],
           _operators(api, tmp_path / "b", 1, EMBER_OPERATOR_SIDECAR_IMAGE="registry.invalid/ember/b:1")[0]]
    try:
        prefix = f"fight-{api.ns}"
        spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 3})
        write_test_archive(minio, prefix, spec)
        api.create_md("qwen", spec)
        wait_for(lambda: phase(api, "qwen") == "Ready", "Ready", ops[0])
        seen: set[str] = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pods = api.core.list_namespaced_pod(api.ns).items
            seen |= {p.metadata.name for p in pods
                     if (p.metadata.labels or {}).get("ember.dev/pool") == "warm"}
            assert len([p for p in pods if p.metadata.deletion_timestamp is None]) <= 4
            time.sleep(0.5)
        assert len(api.warm()) == 3
        assert len(seen) == 3, f"warm pods were replaced (a fight): {sorted(seen)}"
        images = {c.image for p in api.warm() for c in p.spec.init_containers if c.name == "ember-sidecar"}
        assert len(images) == 1
    finally:
        for op in ops:
            op.stop()


def test_scoped_operators_leave_each_others_namespaces_alone(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """The demo's operator owns its namespace, a test's operator its own: objects of one are never
    touched by the other, whatever their settings."""
    apis = [Api(k8s, k8s.create_namespace(n)) for n in ("demo", "tst")]
    ops: list[OperatorProcess] = []
    try:
        for i, api in enumerate(apis):
            api.create_secret("ember-s3", minio)
            image = f"registry.invalid/e/{i}:1"
            ops += _operators(api, tmp_path / api.ns, 1, EMBER_OPERATOR_SIDECAR_IMAGE=image)
        for api in apis:
            spec = md_spec(minio, f"scoped-{api.ns}", replicas=1, warmPool={"size": 2})
            write_test_archive(minio, f"scoped-{api.ns}", spec)
            api.create_md("qwen", spec)
        for api, op in zip(apis, ops, strict=True):
            wait_for(lambda a=api: phase(a, "qwen") == "Ready" and len(a.warm()) == 2, "Ready", op)
        time.sleep(5)
        for i, api in enumerate(apis):
            pods: list[Any] = api.core.list_namespaced_pod(api.ns).items
            assert len(pods) == 3
            images = {c.image for p in pods for c in p.spec.init_containers if c.name == "ember-sidecar"}
            assert images == {f"registry.invalid/e/{i}:1"}
    finally:
        for op in ops:
            op.stop()
        for api in apis:
            k8s.delete_namespace(api.ns)
