"""Admission (schema + CEL) rejections and the failure paths: each ends in a condition with a
reason and a retry, and the deployment still serves through native capture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from operator_harness import Api, OperatorProcess, identity_of, md_spec, operator_env, phase, wait_for
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "opf") as env:
        yield env


def _base(minio: LocalMinio) -> dict[str, Any]:
    return md_spec(minio, "admission")


INVALID: list[tuple[str, Any, str]] = [
    ("sizes-and-preset", lambda s: s["capture"].update(preset="small"), "either sizes or preset"),
    ("size-over-max-batch", lambda s: s["capture"].update(sizes=[1, 2, 16]), "at most capture.maxBatch"),
    ("unsorted-sizes", lambda s: s["capture"].update(sizes=[4, 2, 1]), "sorted ascending"),
    ("zero-size", lambda s: s["capture"].update(sizes=[0, 1]), "positive"),
    ("token-budget-below-batch", lambda s: s["capture"].update(maxNumTokens=4), "maxNumTokens"),
    ("two-stores", lambda s: s["store"].update(local={"path": "/x"}), "exactly one of s3 and local"),
    ("no-store-kind", lambda s: s.update(store={}), "exactly one of s3 and local"),
    ("min-over-max", lambda s: s.update(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
     "minReplicas must be at most"),
    ("gpu-count-mismatch", lambda s: s.update(parallelism={"tensor": 2}, gpu={"product": "X", "count": 1}),
     "gpu.count must equal"),
    ("expert-neither-1-nor-tp-dp", lambda s: s.update(parallelism={"data": 4, "expert": 2}),
     "expert must be 1 or tensor × data"),
    ("alternative-expert-invalid",
     lambda s: s.update(parallelism={"alternatives": [{"data": 2, "expert": 3}]}),
     "expert must be 1 or tensor × data"),
    ("shape-over-one-node", lambda s: s.update(parallelism={"tensor": 16, "data": 8}), "at most 64"),
    ("unknown-engine", lambda s: s["engine"].update(kind="tgi"), "Unsupported value"),
    ("negative-replicas", lambda s: s.update(replicas=-1), "should be greater than or equal to 0"),
    ("missing-model", lambda s: s.pop("model"), "model: Required value"),
    ("bad-gpu-product", lambda s: s.update(gpu={"product": "H100 80GB"}), "gpu.product"),
    ("target-both-values", lambda s: s.update(autoscaling={"maxReplicas": 3, "targets": [
        {"type": "Resource", "name": "cpu", "averageValue": "1", "averageUtilization": 50}]}),
     "exactly one of averageValue and averageUtilization"),
    ("utilization-on-pods-metric", lambda s: s.update(autoscaling={"maxReplicas": 3, "targets": [
        {"type": "Pods", "name": "x", "averageUtilization": 50}]}), "Resource metrics only"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_deployments_are_rejected_at_admission(
    k8s: LocalCluster, minio: LocalMinio, crds: None, case: str, mutate: Any, message: str,
) -> None:
    api = Api(k8s, "default")
    spec = _base(minio)
    mutate(spec)
    with pytest.raises(ApiException) as err:
        api.create_md(f"bad-{case}"[:40], spec, dry_run=True)
    assert err.value.status == 422, err.value.body
    assert message in err.value.body, err.value.body


def test_long_name_is_rejected(k8s: LocalCluster, minio: LocalMinio, crds: None) -> None:
    with pytest.raises(ApiException) as err:
        Api(k8s, "default").create_md("x" * 41, _base(minio), dry_run=True)
    assert err.value.status == 422 and "at most 40 characters" in err.value.body


def test_valid_deployment_is_defaulted(k8s: LocalCluster, minio: LocalMinio, crds: None) -> None:
    created = Api(k8s, "default").create_md("ok", _base(minio), dry_run=True)
    spec = created["spec"]
    assert spec["parallelism"] == {"tensor": 1, "expert": 1, "data": 1, "alternatives": []}
    assert spec["capture"]["graphMode"] == "full" and spec["warmPool"] == {"size": 0, "engine": "ready"}
    assert spec["model"]["revision"] == "main"


def _native(api: Api, name: str, count: int) -> bool:
    pods = api.serving(name)
    return len(pods) == count and all(p.metadata.annotations.get("ember.dev/archive") == "" for p in pods)


def test_missing_secret_serves_natively_and_retries(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    spec["store"]["s3"]["credentialsSecret"] = "not-there"
    api.create_md("nosecret", spec)
    wait_for(lambda: api.condition("nosecret", "ArchiveReady").get("reason") == "CredentialsSecretMissing",
             "ArchiveReady=False CredentialsSecretMissing", op)
    wait_for(lambda: _native(api, "nosecret", 2), "2 native pods", op)
    ga = api.archives()[0]
    assert ga["status"]["nextRetryTime"] and "not-there" in ga["status"]["failureReason"]
    assert api.jobs() == []
    wait_for(lambda: phase(api, "nosecret") == "Degraded", "Degraded (serving natively)", op)
    assert "native capture" in api.condition("nosecret", "ArchiveReady")["message"]
    # The retry picks up the secret once it exists: a SAVE Job starts.
    api.create_secret("not-there", minio)
    wait_for(lambda: api.jobs(), "SAVE Job after the secret appeared", op, timeout=60)


def test_unreachable_store_serves_natively(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    spec["store"]["s3"]["endpoint"] = "http://127.0.0.1:9"  # discard port: connection refused
    api.create_md("nos3", spec)
    wait_for(lambda: api.condition("nos3", "ArchiveReady").get("reason") == "StoreUnreachable",
             "ArchiveReady=False StoreUnreachable", op)
    wait_for(lambda: _native(api, "nos3", 2), "2 native pods", op)
    ga = api.archives()[0]
    assert ga["status"]["phase"] == "Pending" and ga["status"]["nextRetryTime"]
    assert api.jobs() == []
    first_retry = ga["status"]["nextRetryTime"]
    wait_for(lambda: api.archives()[0]["status"]["nextRetryTime"] != first_retry, "a later retry", op)


def test_failed_save_serves_natively_and_retries(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, save={"podAnnotations": {
        "kwok.ember.dev/exit-code": "1",
        "kwok.ember.dev/termination-message": "CUDA error: out of memory during capture",
    }})
    api.create_md("badsave", spec)
    ident = identity_of(spec)
    wait_for(lambda: api.condition("badsave", "ArchiveReady").get("reason") == "SaveFailed",
             "ArchiveReady=False SaveFailed", op)
    wait_for(lambda: _native(api, "badsave", 2), "2 native pods", op)
    ga = api.archive(f"ga-{ident.hash()[:16]}")
    assert ga is not None
    reason = ga["status"].get("failureReason") or api.condition("badsave", "ArchiveReady")["message"]
    assert "out of memory" in reason
    # Backoff (2 s in tests) then a new attempt with its own deterministic name.
    wait_for(lambda: any(j.metadata.name.endswith("-1") for j in api.jobs()), "retry attempt 1", op)
    reasons = {e["reason"] for e in api.events_for("badsave")}
    assert "SaveFailed" in reasons
