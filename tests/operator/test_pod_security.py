"""Pods and SAVE Jobs the operator builds: read-only roots with explicit writable volumes, no API
token in the engine, engine requests an HPA can divide by, and HPA metrics beyond cpu/memory."""

from __future__ import annotations

from typing import Any

from operator_helpers import CTX, md_spec

from ember_operator.api import AutoscalingSpec, GraphArchiveSpec
from ember_operator.hpas import hpa
from ember_operator.jobs import save_job
from ember_operator.planning import archive_object, template_of
from ember_operator.pods import SA_TOKEN_DIR, StoreAccess, warm_pod


def _all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _save_pod() -> dict[str, Any]:
    spec = md_spec()
    ga_spec = GraphArchiveSpec.model_validate(archive_object("ga-x", "default", spec, CTX)["spec"])
    job = save_job(name="j", namespace="default", archive_name="ga-x", archive_uid="u", spec=ga_spec,
                   store=StoreAccess.of(ga_spec.store), sidecar_image="ember:test", timeout_seconds=600,
                   attempt=0)
    return dict(job["spec"]["template"]["spec"])


def test_every_container_is_read_only_non_root_with_no_capabilities() -> None:
    for spec in (warm_pod(template_of("default", md_spec(), CTX))["spec"], _save_pod()):
        assert spec["securityContext"]["runAsNonRoot"] is True
        volumes = {v["name"] for v in spec["volumes"]}
        for c in _all_containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
        engine = spec["containers"][0]
        writable = {m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")}
        assert {"/tmp", "/var/run/ember"} <= writable, engine["name"]
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["HOME"] == "/tmp"  # caches land on the writable volume


def test_only_the_sidecar_gets_a_service_account_token() -> None:
    spec = warm_pod(template_of("default", md_spec(), CTX))["spec"]
    assert spec["automountServiceAccountToken"] is False
    holders = [c["name"] for c in _all_containers(spec)
               if any(m["mountPath"] == SA_TOKEN_DIR for m in c.get("volumeMounts", []))]
    assert holders == ["ember-sidecar"]
    token = next(v for v in spec["volumes"] if v["name"] == "ember-sa-token")["projected"]["sources"]
    assert token[0]["serviceAccountToken"]["expirationSeconds"] <= 3600
    assert _save_pod()["automountServiceAccountToken"] is False


def test_engine_gets_cpu_and_memory_requests_from_the_spec() -> None:
    engine = warm_pod(template_of("default", md_spec(), CTX))["spec"]["containers"][0]
    assert engine["resources"] == {"requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": "1"},
                                   "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    spec = md_spec(engine={"kind": "vllm", "version": "0.26.0", "image": "e:1",
                           "resources": {"requests": {"cpu": "8", "memory": "64Gi"},
                                         "limits": {"cpu": "16"}}},
                   gpu={"product": "NVIDIA-H100-80GB-HBM3", "count": 1})
    t = template_of("default", spec, CTX)
    engine = warm_pod(t)["spec"]["containers"][0]
    assert engine["resources"]["requests"]["cpu"] == "8"
    assert engine["resources"]["limits"] == {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"}
    # Different resources are a different pool: a warm pod is never claimed with the wrong size.
    assert t.pool_key != template_of("default", md_spec(), CTX).pool_key


def test_hpa_supports_pods_and_external_metrics() -> None:
    spec = AutoscalingSpec.model_validate({"maxReplicas": 4, "targets": [
        {"type": "Pods", "name": "vllm:num_requests_waiting", "averageValue": "4"},
        {"type": "External", "name": "queue_depth", "averageValue": "10", "selector": {"queue": "q1"}},
        {"type": "Resource", "name": "cpu", "averageUtilization": 70},
    ]})
    metrics = hpa(md_name="qwen", md_uid="u", namespace="default", spec=spec)["spec"]["metrics"]
    assert metrics[0] == {"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                                   "target": {"type": "AverageValue", "averageValue": "4"}}}
    assert metrics[1] == {"type": "External", "external": {
        "metric": {"name": "queue_depth", "selector": {"matchLabels": {"queue": "q1"}}},
        "target": {"type": "AverageValue", "averageValue": "10"}}}
    assert metrics[2]["resource"] == {"name": "cpu",
                                      "target": {"type": "Utilization", "averageUtilization": 70}}


def test_local_stores_must_lie_under_the_operator_root() -> None:
    import pytest

    from ember_operator.api import under_root

    with pytest.raises(ValueError, match="outside the operator's local store root"):
        template_of("default", md_spec(store={"local": {"path": "/etc"}}), CTX)
    with pytest.raises(ValueError, match="outside"):  # a sibling with the root as a prefix
        template_of("default", md_spec(store={"local": {"path": "/var/lib/ember2"}}), CTX)
    assert template_of("default", md_spec(store={"local": {"path": "/var/lib/ember/a"}}), CTX).store.uri
    assert not under_root("/var/lib/ember/../../etc", "/var/lib/ember")


def test_operator_refuses_a_non_quantity_stored_before_admission_checked_it() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"average_?[vV]alue"):
        AutoscalingSpec.model_validate({"maxReplicas": 2, "targets": [
            {"type": "Pods", "name": "x", "averageValue": "lots"}]})
    for ok in ("8", "500m", "1Gi", "1.5", "2e3"):
        AutoscalingSpec.model_validate({"maxReplicas": 2, "targets": [
            {"type": "Pods", "name": "x", "averageValue": ok}]})


def test_operator_refuses_a_gpu_count_stored_before_admission_checked_it() -> None:
    import pytest
    from pydantic import ValidationError

    gpu = {"product": "NVIDIA-H100-80GB-HBM3", "count": 1}
    must = r"gpu.count 1 must equal parallelism.tensor × parallelism.data \(2\), or be left unset"
    with pytest.raises(ValidationError, match=must):
        md_spec(parallelism={"tensor": 2}, gpu=gpu)
    assert md_spec(parallelism={"tensor": 2}, gpu={**gpu, "count": 2}).gpu_count() == 2
