"""What a platform wires up to a ModelDeployment, on the local control plane: the `Ready`
condition (`kubectl wait --for=condition=Ready`), the deployment's Service and its endpoints
(Ready serving pods only), and `spec.template` reaching the pods the operator creates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_cluster import LocalCluster, LocalMinio
from operator_harness import Api, OperatorProcess, md_spec, operator_env, wait_for, write_test_archive

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "serve") as env:
        yield env


def _endpoint_pods(api: Api, service: str) -> set[str]:
    """Pods the EndpointSlices of `service` list as ready endpoints."""
    slices = api.k8s.kubectl("get", "endpointslices", "-n", api.ns, "-l",
                             f"kubernetes.io/service-name={service}", "-o", "json").stdout
    names = set()
    for item in json.loads(slices)["items"]:
        for ep in item.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") and ep.get("targetRef"):
                names.add(ep["targetRef"]["name"])
    return names


def _wait_ready(api: Api, name: str) -> None:
    api.k8s.kubectl("wait", "-n", api.ns, f"md/{name}", "--for=condition=Ready", "--timeout=90s")


def test_ready_condition_and_a_service_over_ready_serving_pods(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 1})
    write_test_archive(minio, prefix, spec)  # the archive is there: no SAVE Job
    api.create_md("qwen", spec)
    _wait_ready(api, "qwen")
    md = api.md("qwen")
    gen = md["metadata"]["generation"]
    ready = api.condition("qwen", "Ready")
    assert (ready["status"], ready["reason"], md["status"]["phase"]) == ("True", "Ready", "Ready")
    assert md["status"]["observedGeneration"] == gen
    assert {c["type"] for c in md["status"]["conditions"]} >= {"Ready", "ArchiveReady", "Available",
                                                                "Progressing", "Schedulable"}
    assert all(c["observedGeneration"] == gen for c in md["status"]["conditions"])

    # The Service: owned by the deployment, its address in status and in `kubectl get`.
    svc = api.core.read_namespaced_service("qwen", api.ns)
    assert svc.metadata.owner_references[0].kind == "ModelDeployment"
    assert svc.metadata.owner_references[0].uid == md["metadata"]["uid"]
    assert [(p.name, p.port, p.target_port) for p in svc.spec.ports] == [("http", 8000, 8000)]
    assert md["status"]["address"] == f"qwen.{api.ns}.svc:8000"
    table = api.k8s.kubectl("get", "md", "qwen", "-n", api.ns).stdout
    assert "ADDRESS" in table and f"qwen.{api.ns}.svc:8000" in table
    serving = {p.metadata.name for p in api.serving("qwen")}
    warm = wait_for(lambda: {p.metadata.name for p in api.warm()}, "a warm pod", op)
    wait_for(lambda: _endpoint_pods(api, "qwen") == serving, "the serving pod as the only endpoint", op)
    assert not warm & _endpoint_pods(api, "qwen")

    # An edit: Ready again only once the new generation is observed, and every pod in the Service.
    api.k8s.kubectl("scale", "-n", api.ns, "md/qwen", "--replicas=3")
    wait_for(lambda: api.md("qwen")["status"]["observedGeneration"] > gen, "the new generation observed", op)
    _wait_ready(api, "qwen")
    assert api.condition("qwen", "Ready")["observedGeneration"] == api.md("qwen")["metadata"]["generation"]
    serving = {p.metadata.name for p in api.serving("qwen")}
    assert len(serving) == 3
    wait_for(lambda: _endpoint_pods(api, "qwen") == serving, "three endpoints", op)

    # A Service edited by hand gets its selector back.
    api.core.patch_namespaced_service("qwen", api.ns, {"spec": {"selector": {"app": "other"}}})
    api.patch_md("qwen", {"metadata": {"annotations": {"poke": "1"}}})
    wait_for(lambda: api.core.read_namespaced_service("qwen", api.ns).spec.selector.get("ember.dev/pool")
             == "serving", "the selector restored", op)


def test_not_ready_says_why_and_a_foreign_service_is_left_alone(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    api.core.create_namespaced_service(api.ns, {
        "metadata": {"name": "taken"}, "spec": {"ports": [{"port": 80}], "selector": {"app": "mine"}}})
    api.create_md("taken", md_spec(minio, prefix, replicas=1))  # no archive: SAVE runs
    def reported() -> dict[str, Any] | None:
        cond = api.condition("taken", "Progressing")
        return cond if "not this ModelDeployment's" in cond.get("message", "") else None

    progressing = wait_for(reported, "the foreign Service reported", op)
    assert (progressing["status"], progressing["reason"]) == ("False", "CreateRejected")
    ready = api.condition("taken", "Ready")
    assert ready["status"] == "False" and ready["reason"] != "Ready" and ready["message"]
    assert api.core.read_namespaced_service("taken", api.ns).spec.selector == {"app": "mine"}
    assert "address" not in api.md("taken")["status"]
    proc = api.k8s.kubectl("wait", "-n", api.ns, "md/taken", "--for=condition=Ready", "--timeout=2s",
                           check=False)
    assert proc.returncode != 0
