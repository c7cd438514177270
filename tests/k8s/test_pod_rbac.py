"""The chart's ember-pod ServiceAccount, against the real apiserver: a pod-bound token may annotate
its own pod's restore result and nothing else (another pod, labels, other annotations)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_harness import chart_objects, refusal, wait_for
from support.cluster import LocalCluster

pytestmark = [pytest.mark.k8s]
SA = "ember-pod"


@pytest.fixture
def rbac(k8s: LocalCluster) -> Iterator[tuple[str, client.CoreV1Api]]:
    """A namespace with the chart's pod RBAC and admission policy (rendered by helm) applied."""
    ns = k8s.create_namespace("oprbac")
    release = f"rbac-{uuid.uuid4().hex[:6]}"
    try:
        with chart_objects(k8s, release, "pod-rbac.yaml", f"workloadNamespaces={{{ns}}}"):
            yield ns, client.CoreV1Api(k8s.api_client)
    finally:
        k8s.delete_namespace(ns)


def _pod(core: client.CoreV1Api, ns: str, name: str) -> Any:
    return core.create_namespaced_pod(ns, client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app": "x"}),
        spec=client.V1PodSpec(service_account_name=SA, automount_service_account_token=False,
                              containers=[client.V1Container(name="c", image="registry.invalid/x:1")]),
    ))


def _as(k8s: LocalCluster, core: client.CoreV1Api, ns: str, pod: Any | None) -> client.CoreV1Api:
    """A client authenticated as the ServiceAccount, with a token bound to `pod` (or unbound)."""
    bound = (client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod.metadata.name,
                                           uid=pod.metadata.uid) if pod is not None else None)
    token = core.create_namespaced_service_account_token(SA, ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], bound_object_ref=bound, expiration_seconds=600),
    )).status.token
    cfg = copy.copy(k8s.api_client.configuration)
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(cfg))



def test_a_pod_token_may_only_annotate_its_own_pod(
    k8s: LocalCluster, rbac: tuple[str, client.CoreV1Api],
) -> None:
    ns, core = rbac
    a, b = _pod(core, ns, "a"), _pod(core, ns, "b")
    as_a = _as(k8s, core, ns, a)
    result = {"metadata": {"annotations": {"ember.dev/restore": "restored"}}}
    # The policy needs a moment to reach the apiserver's admission: wait until it denies.
    body = wait_for(lambda: refusal(lambda: as_a.patch_namespaced_pod("b", ns, result)),
                    "the policy denying a patch of another pod", timeout=30)
    assert "may change only its own pod" in body, body
    as_a.patch_namespaced_pod("a", ns, result)  # its own restore result: allowed
    assert core.read_namespaced_pod("a", ns).metadata.annotations["ember.dev/restore"] == "restored"
    as_a.patch_namespaced_pod("a", ns, {"metadata": {"annotations": {"ember.dev/engine": "ready"}}})
    assert core.read_namespaced_pod("a", ns).metadata.annotations["ember.dev/engine"] == "ready"
    assert "labels" in refusal(lambda: as_a.patch_namespaced_pod(
        "a", ns, {"metadata": {"labels": {"app": "y"}}}))
    assert "restore* annotations" in refusal(lambda: as_a.patch_namespaced_pod(
        "a", ns, {"metadata": {"annotations": {"ember.dev/archive": "s3://elsewhere"}}}))
    # A token not bound to a pod (a plain TokenRequest) may patch no pod at all.
    unbound = _as(k8s, core, ns, None)
    assert "may change only its own pod" in refusal(lambda: unbound.patch_namespaced_pod("a", ns, result))
    assert b.metadata.name == "b"
