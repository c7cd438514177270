"""Smoke tests of the real local control plane (e2e/cluster.sh): CRDs, scheduling onto fake
GPU nodes, Jobs run by kube-controller-manager, and the scale subresource."""

from __future__ import annotations

import contextlib

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from support.cluster import wait_until

pytestmark = pytest.mark.k8s

GROUP = "smoke.ember.dev"
CRD_NAME = f"widgets.{GROUP}"
CPU_TARGET = {"type": "Utilization", "averageUtilization": 80}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _crd_body() -> dict:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {"size": {"type": "integer", "minimum": 1}, "model": {"type": "string"}},
            },
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def _established(ext: client.ApiextensionsV1Api) -> bool:
    crd = ext.read_custom_resource_definition(CRD_NAME)
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))


def _pod(name: str, *, gpus: int = 0, product: str | None = None, tolerate: bool = True) -> dict:
    container: dict = {"name": "main", "image": "registry.invalid/ember/smoke:1"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict = {"containers": [container], "restartPolicy": "Never"}
    if tolerate:
        spec["tolerations"] = [GPU_TOLERATION]
    if product:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_crd_roundtrip(k8s, k8s_namespace) -> None:
    ext = client.ApiextensionsV1Api(k8s.api_client)
    objs = client.CustomObjectsApi(k8s.api_client)
    with contextlib.suppress(ApiException):  # left over from an earlier session: reuse it
        ext.create_custom_resource_definition(_crd_body())
    wait_until(lambda: _established(ext), timeout=30, what=f"CRD {CRD_NAME} Established")

    body = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": "w1", "labels": {"ember.dev/smoke": "yes"}},
        "spec": {"size": 3, "model": "llama"},
    }
    # A freshly established CRD can take a moment to be served by every handler.
    created = wait_until(
        lambda: _try(
            lambda: objs.create_namespaced_custom_object(GROUP, "v1", k8s_namespace, "widgets", body)
        ),
        timeout=30,
        what="custom object create",
    )
    assert created["metadata"]["uid"]

    got = objs.get_namespaced_custom_object(GROUP, "v1", k8s_namespace, "widgets", "w1")
    assert got["spec"] == {"size": 3, "model": "llama"}
    assert got["metadata"]["labels"]["ember.dev/smoke"] == "yes"

    patched = objs.patch_namespaced_custom_object(
        GROUP, "v1", k8s_namespace, "widgets", "w1", {"spec": {"size": 5}}
    )
    assert patched["spec"]["size"] == 5
    assert patched["metadata"]["generation"] == 2

    status = objs.patch_namespaced_custom_object_status(
        GROUP, "v1", k8s_namespace, "widgets", "w1", {"status": {"phase": "Ready"}}
    )
    assert status["status"] == {"phase": "Ready"}
    assert status["metadata"]["generation"] == 2  # status writes do not bump generation

    listed = objs.list_namespaced_custom_object(
        GROUP, "v1", k8s_namespace, "widgets", label_selector="ember.dev/smoke=yes"
    )
    assert [o["metadata"]["name"] for o in listed["items"]] == ["w1"]

    # The apiserver enforces the structural schema.
    bad = {**body, "metadata": {"name": "w2"}, "spec": {"size": 0}}
    with pytest.raises(ApiException) as err:
        objs.create_namespaced_custom_object(GROUP, "v1", k8s_namespace, "widgets", bad)
    assert err.value.status == 422


def _try(fn):
    try:
        return fn()
    except ApiException as exc:
        if exc.status in (404, 503):
            return None
        raise


def _phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod(name, ns).status.phase


def test_gpu_pod_scheduled_onto_fake_gpu_node(k8s, k8s_namespace) -> None:
    core = client.CoreV1Api(k8s.api_client)
    nodes = core.list_node(label_selector="nvidia.com/gpu.product=NVIDIA-H200").items
    assert [n.metadata.name for n in nodes] == ["ember-gpu-h200-0"]
    assert nodes[0].status.allocatable["nvidia.com/gpu"] == "8"

    core.create_namespaced_pod(k8s_namespace, _pod("gpu", gpus=1, product="NVIDIA-H200"))
    wait_until(lambda: _phase(core, k8s_namespace, "gpu") == "Running", timeout=60, what="GPU pod Running")
    pod = core.read_namespaced_pod("gpu", k8s_namespace)
    assert pod.spec.node_name == "ember-gpu-h200-0"
    assert pod.status.pod_ip
    ready = {c.type: c.status for c in pod.status.conditions}
    assert ready["Ready"] == "True"
    assert pod.status.container_statuses[0].state.running is not None


def test_gpu_taint_and_capacity_are_enforced(k8s, k8s_namespace) -> None:
    core = client.CoreV1Api(k8s.api_client)
    # No toleration: only the untainted CPU node fits, and it has no GPUs.
    core.create_namespaced_pod(k8s_namespace, _pod("no-toleration", gpus=1, tolerate=False))
    # More GPUs than any node has.
    core.create_namespaced_pod(k8s_namespace, _pod("too-many", gpus=9, product="NVIDIA-H100-80GB-HBM3"))

    def unschedulable(name: str) -> bool:
        pod = core.read_namespaced_pod(name, k8s_namespace)
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in (pod.status.conditions or [])
        )

    for name in ("no-toleration", "too-many"):
        wait_until(lambda name=name: unschedulable(name), timeout=60, what=f"{name} Unschedulable")
        pod = core.read_namespaced_pod(name, k8s_namespace)
        assert pod.spec.node_name is None
        assert pod.status.phase == "Pending"


def _job(name: str, annotations: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": annotations or {}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "registry.invalid/ember/smoke:1"}],
                },
            },
        },
    }


def _job_condition(batch: client.BatchV1Api, ns: str, name: str) -> str | None:
    job = batch.read_namespaced_job(name, ns)
    for cond in job.status.conditions or []:
        if cond.type in ("Complete", "Failed") and cond.status == "True":
            return cond.type
    return None


def test_job_completes(k8s, k8s_namespace) -> None:
    batch = client.BatchV1Api(k8s.api_client)
    core = client.CoreV1Api(k8s.api_client)
    batch.create_namespaced_job(k8s_namespace, _job("ok"))
    cond = wait_until(lambda: _job_condition(batch, k8s_namespace, "ok"), timeout=90, what="Job finished")
    assert cond == "Complete"
    job = batch.read_namespaced_job("ok", k8s_namespace)
    assert job.status.succeeded == 1
    pods = core.list_namespaced_pod(k8s_namespace, label_selector="job-name=ok").items
    assert [p.status.phase for p in pods] == ["Succeeded"]
    assert pods[0].spec.node_name == "ember-cpu-0"  # GPU nodes are tainted


def test_job_failure_carries_exit_code_and_termination_message(k8s, k8s_namespace) -> None:
    """The kwok stages let a test fail a Job pod and set its termination message."""
    batch = client.BatchV1Api(k8s.api_client)
    core = client.CoreV1Api(k8s.api_client)
    annotations = {"kwok.ember.dev/exit-code": "3", "kwok.ember.dev/termination-message": "boom: no GPU"}
    batch.create_namespaced_job(k8s_namespace, _job("bad", annotations))
    cond = wait_until(lambda: _job_condition(batch, k8s_namespace, "bad"), timeout=90, what="Job finished")
    assert cond == "Failed"
    pods = core.list_namespaced_pod(k8s_namespace, label_selector="job-name=bad").items
    terminated = pods[0].status.container_statuses[0].state.terminated
    assert (pods[0].status.phase, terminated.exit_code, terminated.message) == ("Failed", 3, "boom: no GPU")


def test_deployment_scales_through_scale_subresource(k8s, k8s_namespace) -> None:
    apps = client.AppsV1Api(k8s.api_client)
    labels = {"app": "scaled"}
    apps.create_namespaced_deployment(
        k8s_namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "scaled"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "main", "image": "registry.invalid/ember/smoke:1"}]},
                },
            },
        },
    )
    apps.patch_namespaced_deployment_scale("scaled", k8s_namespace, {"spec": {"replicas": 3}})
    assert apps.read_namespaced_deployment_scale("scaled", k8s_namespace).spec.replicas == 3
    wait_until(
        lambda: (apps.read_namespaced_deployment("scaled", k8s_namespace).status.ready_replicas or 0) == 3,
        timeout=90,
        what="3 ready replicas",
    )
    # The HPA controller acts on the same subresource: an HPA whose minReplicas is above the
    # current count scales the Deployment up even without a metrics source.
    client.AutoscalingV2Api(k8s.api_client).create_namespaced_horizontal_pod_autoscaler(
        k8s_namespace,
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "scaled"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scaled"},
                "minReplicas": 4,
                "maxReplicas": 6,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": CPU_TARGET}}],
            },
        },
    )
    wait_until(
        lambda: apps.read_namespaced_deployment_scale("scaled", k8s_namespace).spec.replicas == 4,
        timeout=90,
        what="HPA raising replicas to minReplicas",
    )


def test_hpa_scales_on_fake_cpu_usage(k8s, k8s_namespace) -> None:
    """metrics-server reads kwok's fake kubelet metrics; the HPA scales on pod CPU utilization."""
    apps = client.AppsV1Api(k8s.api_client)
    labels = {"app": "busy"}
    container = {
        "name": "main",
        "image": "registry.invalid/ember/smoke:1",
        "resources": {"requests": {"cpu": "1"}},
    }
    apps.create_namespaced_deployment(
        k8s_namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "busy"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    # 900m of a 1-CPU request: 90% utilization against a 50% target.
                    "metadata": {"labels": labels, "annotations": {"kwok.x-k8s.io/usage-cpu": "900m"}},
                    "spec": {"containers": [container]},
                },
            },
        },
    )
    metrics = client.CustomObjectsApi(k8s.api_client)

    def pod_cpu_reported() -> bool:
        items = metrics.list_namespaced_custom_object("metrics.k8s.io", "v1beta1", k8s_namespace, "pods")
        return any(c["usage"]["cpu"] not in ("0", "0n") for i in items["items"] for c in i["containers"])

    wait_until(pod_cpu_reported, timeout=90, interval=2, what="pod CPU in metrics.k8s.io")

    client.AutoscalingV2Api(k8s.api_client).create_namespaced_horizontal_pod_autoscaler(
        k8s_namespace,
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "busy"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "busy"},
                "minReplicas": 1,
                "maxReplicas": 4,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 50},
                        },
                    }
                ],
            },
        },
    )
    wait_until(
        lambda: apps.read_namespaced_deployment_scale("busy", k8s_namespace).spec.replicas >= 2,
        timeout=120,
        interval=2,
        what="HPA scaling up on 90% CPU utilization",
    )
