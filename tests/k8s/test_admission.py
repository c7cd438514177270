"""Inputs the operator used to accept and then mishandle, refused by the real apiserver at admission
(schema patterns and CEL rules generated from operator/ember_operator/api.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from operator_harness import Api, md_spec
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


def _s3(spec: dict[str, Any], **over: Any) -> None:
    spec["store"]["s3"].update(over)


def _hpa(spec: dict[str, Any], *targets: dict[str, Any], **over: Any) -> None:
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "targets": list(targets), **over}


INVALID: list[tuple[str, Any, str]] = [
    ("image-leading-space", lambda s: s["engine"].update(image=" registry.invalid/e:1"), "engine.image"),
    ("image-trailing-space", lambda s: s["engine"].update(image="registry.invalid/e:1 "), "engine.image"),
    ("annotation-key", lambda s: s.update(save={"podAnnotations": {"not a key!": "x"}}),
     "annotation keys must be valid label keys"),
    ("annotation-key-long-name", lambda s: s.update(save={"podAnnotations": {"a/" + "n" * 64: "x"}}),
     "annotation keys must be valid label keys"),
    ("secret-not-dns", lambda s: _s3(s, credentialsSecret="Ember_S3"), "credentialsSecret"),
    ("endpoint-no-host", lambda s: _s3(s, endpoint="http://"), "endpoint"),
    ("endpoint-path-only", lambda s: _s3(s, endpoint="http:///bucket"), "endpoint"),
    ("pvc-not-dns", lambda s: s.update(store={"local": {"path": "/data", "persistentVolumeClaim": "My PVC"}}),
     "persistentVolumeClaim"),
    ("local-path-dotdot", lambda s: s.update(store={"local": {"path": "/data/../etc"}}),
     "must not contain '..'"),
    ("average-value-not-quantity", lambda s: _hpa(s, {"type": "Pods", "name": "x", "averageValue": "lots"}),
     "averageValue must be a quantity"),
    ("replicas-zero-with-hpa", lambda s: (s.update(replicas=0), _hpa(s, minReplicas=5, maxReplicas=8)),
     "replicas 0 turns the HPA off"),
    ("hpa-on-gpu", lambda s: _hpa(s, {"type": "Resource", "name": "nvidia.com/gpu",
                                      "averageUtilization": 80}),
     "Resource metrics are cpu or memory"),
    ("selector-on-pods-metric", lambda s: _hpa(s, {"type": "Pods", "name": "x", "averageValue": "4",
                                                   "selector": {"a": "b"}}), "selector applies to External"),
    ("huge-args", lambda s: s["engine"].update(args=["x" * 5000]), "engine.args"),
    ("huge-compile", lambda s: s["capture"].update(compile={f"k{i}": "v" for i in range(64)}), "compile"),
    ("huge-annotation-value", lambda s: s.update(save={"podAnnotations": {"a": "x" * 5000}}),
     "podAnnotations"),
    ("resources-not-quantity", lambda s: s["engine"].update(resources={"requests": {"cpu": "lots"}}),
     "values must be quantities"),
    ("resources-gpu", lambda s: s["engine"].update(resources={"limits": {"nvidia.com/gpu": "1"}}),
     "only cpu, memory and ephemeral-storage"),
    # Identity strings reach SAVE Jobs, engine arguments and store keys: a safe character set.
    ("model-newline", lambda s: s["model"].update(name="Qwen/Qwen3\n--trust-remote-code"), "model.name"),
    ("model-unicode", lambda s: s["model"].update(name="Qwen/Qwen3-0.6B\u202e"), "model.name"),
    ("model-dotdot", lambda s: s["model"].update(name="../../etc/passwd"), "model.name"),
    ("revision-traversal", lambda s: s["model"].update(revision="../../../etc/passwd"), "model.revision"),
    ("dtype-unknown", lambda s: s["model"].update(dtype="float1024"), "model.dtype"),
    ("engine-version-shell", lambda s: s["engine"].update(version="$(reboot)"), "engine.version"),
    # a vLLM the adapter cannot restore would capture natively on every start
    ("vllm-version-unrestorable", lambda s: s["engine"].update(kind="vllm", version="0.11.0"),
     "ember restores vLLM 0.26.x only"),
    ("vllm-version-lookalike", lambda s: s["engine"].update(kind="vllm", version="0.260.0"),
     "ember restores vLLM 0.26.x only"),
    # the transformers engine cannot free its KV cache (its restored graphs point at it)
    ("sleeping-transformers", lambda s: s.update(warmPool={"size": 1, "engine": "sleeping"}),
     "warmPool.engine sleeping needs engine.kind vllm"),
    # a transformers pod's command sets these (`ember serve --run-dir … --host … --port …`)
    ("transformers-port", lambda s: s["engine"].update(args=["--layers", "2", "--port", "9000"]),
     "are ember's in a transformers pod"),
    ("transformers-no-handoff", lambda s: s["engine"].update(args=["--no-handoff"]),
     "are ember's in a transformers pod"),
    ("transformers-host-equals", lambda s: s["engine"].update(args=["--host=127.0.0.1"]),
     "are ember's in a transformers pod"),
    ("bucket-characters", lambda s: _s3(s, bucket="My_Bucket!"), "bucket"),
    ("trusted-key-not-a-key", lambda s: s.update(archive={"signing": {"trustedKeys": [
        {"id": "k", "publicKey": "this is not a public key at all, just text"}]}}), "publicKey"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_mishandled_inputs_are_rejected_at_admission(
    k8s: LocalCluster, minio: LocalMinio, crds: None, case: str, mutate: Any, message: str,
) -> None:
    spec = md_spec(minio, "admission")
    mutate(spec)
    with pytest.raises(ApiException) as err:
        Api(k8s, "default").create_md(f"bad-{case}"[:40], spec, dry_run=True)
    assert err.value.status == 422, err.value.body
    assert message in err.value.body, err.value.body


def test_resources_external_metrics_and_label_keys_are_accepted(
    k8s: LocalCluster, minio: LocalMinio, crds: None,
) -> None:
    spec = md_spec(minio, "admission", save={"podAnnotations": {"example.com/mesh": "off", "plain": "1"}})
    _hpa(spec, {"type": "External", "name": "ember_requests_waiting", "averageValue": "4",
                "selector": {"queue": "q1"}},
         {"type": "Resource", "name": "cpu", "averageUtilization": 70},
         {"type": "Pods", "name": "vllm_num_requests_waiting", "averageValue": "500m"})
    spec["model"] = {"name": "/models/Qwen3-0.6B", "revision": "refs/pr/1", "dtype": "float16"}
    spec["engine"] = {**spec["engine"], "kind": "vllm", "version": "0.26.1rc1+cu128",  # a restorable vLLM
                      "args": ["--port", "9000"]}  # vLLM's own: only transformers pods' command sets it
    spec["warmPool"] = {"size": 1, "engine": "sleeping"}  # vLLM's sleep mode
    created = Api(k8s, "default").create_md("ok-inputs", spec, dry_run=True)
    # Defaults: the engine gets CPU and memory requests, so a utilization target can act.
    assert created["spec"]["engine"]["resources"]["requests"] == {"cpu": "2", "memory": "16Gi"}
    assert created["spec"]["warmPool"]["engine"] == "sleeping"
    plain = Api(k8s, "default").create_md("ok-default", md_spec(minio, "admission"), dry_run=True)
    assert plain["spec"]["warmPool"] == {"size": 0, "engine": "ready"}
    cb = md_spec(minio, "admission")
    args = ["--model=tiny-llama", "--layers", "2", "--deadline", "60"]  # `ember serve` options
    cb["engine"]["args"] = args
    assert Api(k8s, "default").create_md("ok-cb", cb, dry_run=True)["spec"]["engine"]["args"] == args
