"""The CRDs are generated from api.py, structural, documented, and carry the CEL rules."""

from __future__ import annotations

from typing import Any

from ember_operator import crdgen

EXPECTED_RULE_MESSAGES = [
    "capture: set either sizes or preset, not both",
    "capture.sizes must be positive and at most capture.maxBatch",
    "capture.sizes must be sorted ascending",
    "capture.maxNumTokens (token budget) must be at least capture.maxBatch",
    "store: set exactly one of s3 and local",
    "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
    "gpu.count must equal parallelism.tensor × parallelism.data (or be left unset)",
    "parallelism: expert must be 1 or tensor × data (vLLM's expert-parallel size is tensor × data)",
    "parallelism: tensor × data is the GPUs of one pod on one node: at most 64",
    "autoscaling target: set exactly one of averageValue and averageUtilization",
    "engine.version: ember restores vLLM 0.26.x only (the adapter patches their internals); another "
    "version would capture natively on every start",
    "warmPool.engine sleeping needs engine.kind vllm (its sleep mode frees the KV cache); the "
    "transformers engine's restored graphs point at its KV cache, so its warm pods always hold it: use ready",
]


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in (node.get("properties") or {}).items():
            yield from _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")


def test_files_on_disk_match_the_models() -> None:
    assert crdgen.main(["--check"]) == 0, "run python -m ember_operator.crdgen"


def test_model_deployment_crd_shape() -> None:
    crd = crdgen.model_deployment_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["md"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Ready", "Archive", "Age"} <= columns


def _messages(node: Any) -> list[str]:
    out: list[str] = []
    if isinstance(node, dict):
        out += [r["message"] for r in node.get("x-kubernetes-validations", [])]
        for value in node.values():
            out += _messages(value)
    elif isinstance(node, list):
        for value in node:
            out += _messages(value)
    return out


def test_cel_rules_present() -> None:
    messages = _messages(crdgen.model_deployment_crd())
    for message in EXPECTED_RULE_MESSAGES:
        assert message in messages, message
    assert any("at most 40 characters" in m for m in messages)


def test_schema_is_structural_and_documented() -> None:
    for crd in (crdgen.model_deployment_crd(), crdgen.graph_archive_crd()):
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema["properties"]["spec"], "spec"):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
            assert "type" in node, path
            if path.count(".") >= 1 and not path.endswith("[]"):
                assert node.get("description"), f"{path} has no description (kubectl explain)"
            if node.get("additionalProperties") is not None:
                assert node["additionalProperties"] is not False, path


def test_optional_objects_are_not_defaulted_but_nested_defaults_apply() -> None:
    schema = crdgen.model_deployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    props = spec["properties"]
    # Nested defaults spelled out (the apiserver checks CEL rules against the default as written).
    assert props["capture"]["default"] == {"graphMode": "full", "compile": {}, "maxNumTokens": 8192,
                                           "maxBatch": 512}
    assert props["parallelism"]["default"] == {"tensor": 1, "expert": 1, "data": 1, "alternatives": []}
    assert "default" not in props["store"]
    assert "default" not in props["autoscaling"]
    assert "default" not in props["store"]["properties"]["s3"]
    assert props["replicas"]["default"] == 1


def test_grapharchive_is_namespaced_with_status() -> None:
    crd = crdgen.graph_archive_crd()
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["ga"]
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in ("phase", "uri", "bytes", "digest", "compatKey", "saveJob", "durations", "failureReason"):
        assert field in status, field
