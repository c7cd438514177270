"""Events have deterministic names: the same event posted twice is one object whose count says 2
(operator: events.k8s.io series; sidecar: core/v1 count), on the real local apiserver."""

from __future__ import annotations

import pytest
from kubernetes import client, config
from support.cluster import LocalCluster

from ember import contract
from ember_operator.conditions import Event
from ember_operator.kube import Kube
from ember_operator.reconcilers import Reconciler
from ember_operator.settings import Settings
from ember_sidecar.reporting import KubeReporter

pytestmark = pytest.mark.k8s


def test_operator_event_repeats_become_a_series(k8s: LocalCluster, k8s_namespace: str) -> None:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(k8s.kubeconfig), client_configuration=cfg)
    rec = Reconciler(Kube(cfg), Settings.from_env({}))
    obj = {"apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT,
           "metadata": {"name": "md-ev", "namespace": k8s_namespace, "uid": "0b7c-uid"}}
    rec.post_events(obj, [Event("Warning", "SaveFailed", "SAVE failed: boom")])
    rec.post_events(obj, [Event("Warning", "SaveFailed", "SAVE failed: boom")])  # a retried reconcile
    rec.post_events(obj, [Event("Normal", "Phase", "phase Saving → Ready")])
    events = client.EventsV1Api(k8s.api_client).list_namespaced_event(k8s_namespace).items
    failed = [e for e in events if e.reason == "SaveFailed"]
    assert len(failed) == 1 and failed[0].series is not None and failed[0].series.count == 2
    assert failed[0].metadata.name == contract.event_name("md-ev", "0b7c-uid", "Warning", "SaveFailed",
                                                          "SAVE failed: boom")
    assert [e.series for e in events if e.reason == "Phase"] == [None]


def test_sidecar_event_repeats_count_up(k8s: LocalCluster, k8s_namespace: str) -> None:
    core = client.CoreV1Api(k8s.api_client)
    reporter = KubeReporter(k8s.api_client, k8s_namespace, "pod-ev")
    reporter.event("Warning", "RestoreFallback", "digest-mismatch: blob 3")
    reporter.event("Warning", "RestoreFallback", "digest-mismatch: blob 3")
    reporter.event("Warning", "RestoreFallback", "store-unavailable: timeout")
    events = core.list_namespaced_event(k8s_namespace).items
    counts = sorted((e.message, e.count) for e in events if e.reason == "RestoreFallback")
    assert counts == [("digest-mismatch: blob 3", 2), ("store-unavailable: timeout", 1)]
