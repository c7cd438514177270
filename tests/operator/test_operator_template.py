"""`spec.template` merged into serving, warm and SAVE pods: every field arrives, ember's own parts
stay (the same on the local cluster, with admission's refusals: tests/k8s/test_operator_serving.py)."""

from __future__ import annotations

from typing import Any

from operator_helpers import CTX, md_spec

from ember import contract
from ember.contract import Claim
from ember_operator.api import GraphArchiveSpec
from ember_operator.jobs import save_job
from ember_operator.planning import archive_object, template_of
from ember_operator.pods import StoreAccess, serving_pod, warm_pod

TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"sidecar.istio.io/inject": "false"}},
    "spec": {
        "serviceAccountName": "llm-reader",
        "priorityClassName": "serving-high",
        "imagePullSecrets": [{"name": "regcred"}],
        "nodeSelector": {"topology.kubernetes.io/zone": "z1"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"team": "search"}},
                        },
                    }
                ]
            }
        },
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        ],
        "containers": [
            {
                "name": "engine",
                "env": [
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                    {"name": "HF_HOME", "value": "/models"},
                    {"name": "HOME", "value": "/models/home"},
                ],
                "envFrom": [{"configMapRef": {"name": "engine-env"}}],
                "volumeMounts": [
                    {"name": "model-cache", "mountPath": "/models"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
                "resources": {
                    "requests": {"memory": "32Gi", "hugepages-2Mi": "1Gi"},
                    "limits": {"hugepages-2Mi": "1Gi"},
                },
            }
        ],
    },
}


def _spec() -> Any:
    return md_spec(template=TEMPLATE)


def _claim() -> Claim:
    return Claim(deployment="qwen", identity=_spec().identity().hash(), revision="r", archive_uri="")


def _job(spec: Any, priority_class: str = "") -> dict[str, Any]:
    ga = GraphArchiveSpec.model_validate(
        archive_object("ga-x", "default", spec, CTX, None, priority_class)["spec"]
    )
    return save_job(
        name="j",
        namespace="default",
        archive_name="ga-x",
        archive_uid="u",
        spec=ga,
        store=StoreAccess.of(ga.store),
        sidecar_image="ember:test",
        timeout_seconds=600,
        attempt=0,
    )


def _pods() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(metadata, spec) of a serving pod, a warm pod and a SAVE pod of the templated deployment."""
    t = template_of("default", _spec(), CTX)
    job = _job(_spec())["spec"]["template"]
    return [
        (p["metadata"], p["spec"]) for p in (serving_pod(t, _claim(), "p", "u"), warm_pod(t, name="w"))
    ] + [(job["metadata"], job["spec"])]


def test_every_field_reaches_serving_warm_and_save_pods() -> None:
    for meta, spec in _pods():
        assert meta["labels"]["team"] == "search"
        assert meta["labels"][contract.LABEL_MANAGED_BY] == contract.MANAGED_BY_OPERATOR
        assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
        assert spec["serviceAccountName"] == "llm-reader" and spec["priorityClassName"] == "serving-high"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["nodeSelector"] == {
            "topology.kubernetes.io/zone": "z1",
            contract.GPU_PRODUCT_NODE_LABEL: "NVIDIA-H100-80GB-HBM3",
        }
        assert [t.get("key") for t in spec["tolerations"]] == [contract.GPU_RESOURCE, "dedicated"]
        assert spec["affinity"] == TEMPLATE["spec"]["affinity"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and "ember-run" in volumes
        (engine,) = spec["containers"]
        env = {e["name"]: e for e in engine["env"]}
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert env["HOME"]["value"] == "/models/home"  # an ember default, replaced
        assert [e["name"] for e in engine["env"]].count("HOME") == 1
        assert env["LD_PRELOAD"]["value"] == contract.LIB_PATH  # ember's own, kept
        assert {"configMapRef": {"name": "engine-env"}} in engine["envFrom"]
        mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        assert mounts["/models"] == "model-cache" and mounts["/dev/shm"] == "dshm"
        assert mounts[contract.RUN_DIR] == "ember-run"
        res = engine["resources"]
        assert res["requests"]["memory"] == "32Gi" and res["requests"]["hugepages-2Mi"] == "1Gi"
        assert res["requests"]["cpu"] == "2" and res["limits"]["hugepages-2Mi"] == "1Gi"
        assert res["limits"]["memory"] == "32Gi"  # the defaulted limit follows a larger request
        assert engine["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_gpus_stay_ember_and_save_pods_are_never_best_effort() -> None:
    serving, _warm, save = (spec["containers"][0]["resources"] for _, spec in _pods())
    assert serving["limits"][contract.GPU_RESOURCE] == "1" and save["limits"][contract.GPU_RESOURCE] == "1"
    plain = _job(md_spec())["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert plain["requests"] == {"cpu": "2", "memory": "16Gi"}


def test_a_presave_keeps_its_low_priority() -> None:
    job = _job(_spec(), priority_class="ember-presave")
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "ember-presave"


def test_the_template_is_part_of_the_pool_key_and_an_empty_one_is_not() -> None:
    plain = template_of("default", md_spec(), CTX)
    assert template_of("default", md_spec(template={}), CTX).pool_key == plain.pool_key
    assert template_of("default", md_spec(template={"spec": {"volumes": []}}), CTX).pool_key == plain.pool_key
    assert template_of("default", _spec(), CTX).pool_key != plain.pool_key
    assert warm_pod(plain, name="w") == warm_pod(template_of("default", md_spec(template={}), CTX), name="w")


def test_knobs_that_fake_weaken_or_are_unproven_are_pinned_where_envfrom_could_set_them() -> None:
    """The template's envFrom (a ConfigMap, a Secret) may hold any variable, and `env` refuses
    only names it spells out: the engine and SAVE containers pin the tests' faults, the bench's
    skipped canary, its eager reference on one GPU and native capture, the unproven union layouts
    and compile setting (whose archives the operator's identity does not name) and the canary's
    FULL check to their defaults, and a container's own env wins over envFrom. Tuning knobs stay
    open."""
    from ember import settings

    for _, spec in _pods():
        (engine,) = spec["containers"]
        assert {"configMapRef": {"name": "engine-env"}} in engine["envFrom"]
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert {n: env.get(n) for n in settings.PINNED} == {
            "EMBER_FAULT": "", "EMBER_SWAP_AT_LAUNCH": "", "EMBER_VLLM_CANARY": "1",
            "EMBER_VLLM_CANARY_EAGER": "0", "EMBER_VLLM_CAPTURE_NATIVELY": "0",
            "EMBER_UNION_PROGRAMMATIC": "0", "EMBER_UNION_MEMSETS": "0",
            "EMBER_VLLM_CANARY_FULL_EAGER": "1", "EMBER_VLLM_MEGA_AOT": "0"}
        assert "EMBER_EXEC_MEMORY_MB" not in env and "EMBER_DEDICATE" not in env
