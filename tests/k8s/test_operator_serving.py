"""What a platform wires up to a ModelDeployment, on the local control plane: the `Ready`
condition (`kubectl wait --for=condition=Ready`), the deployment's Service and its endpoints
(Ready serving pods only), and `spec.template` reaching the pods the operator creates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from operator_harness import Api, OperatorProcess, md_spec, operator_env, wait_for, write_test_archive
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


@pytest.fixture
def env(
    k8s: LocalCluster,
    minio: LocalMinio,
    crds: None,
    tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "serve") as env:
        yield env


def _endpoint_pods(api: Api, service: str) -> set[str]:
    """Pods the EndpointSlices of `service` list as ready endpoints."""
    slices = api.k8s.kubectl(
        "get", "endpointslices", "-n", api.ns, "-l", f"kubernetes.io/service-name={service}", "-o", "json"
    ).stdout
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
    # SAVE pods (below) keep running under kwok.
    save = {"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}
    spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 1}, save=save)
    write_test_archive(minio, prefix, spec)  # the archive is there: no SAVE Job
    api.create_md("qwen", spec)
    _wait_ready(api, "qwen")
    md = api.md("qwen")
    gen = md["metadata"]["generation"]
    ready = api.condition("qwen", "Ready")
    assert (ready["status"], ready["reason"], md["status"]["phase"]) == ("True", "Ready", "Ready")
    assert md["status"]["observedGeneration"] == gen
    assert {c["type"] for c in md["status"]["conditions"]} >= {
        "Ready",
        "ArchiveReady",
        "Available",
        "Progressing",
        "Schedulable",
    }
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
    wait_for(
        lambda: (
            api.core.read_namespaced_service("qwen", api.ns).spec.selector
            == {"ember.dev/deployment": "qwen", "ember.dev/pool": "serving"}
        ),
        "the selector restored",
        op,
    )

    # A new identity: its SAVE pod runs (Ready) while the old pods keep serving; never an endpoint.
    api.patch_md("qwen", {"spec": {"engine": {"args": ["--layers", "2"]}}})
    wait_for(lambda: api.condition("qwen", "Ready").get("reason") == "Reconfiguring", "Ready=False", op)
    save_pod = wait_for(lambda: next(iter(api.pods("ember.dev/archive")), None), "the SAVE pod", op)
    wait_for(
        lambda: any(
            c.type == "Ready" and c.status == "True"
            for c in (api.core.read_namespaced_pod(save_pod.metadata.name, api.ns).status.conditions or [])
        ),
        "the SAVE pod Ready",
        op,
    )
    # (the endpoints come back after the selector edit above: wait for them)
    wait_for(lambda: _endpoint_pods(api, "qwen") == serving, "the old pods as the endpoints", op)
    assert save_pod.metadata.name not in _endpoint_pods(api, "qwen")


def test_not_ready_says_why_and_a_foreign_service_is_left_alone(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    api.core.create_namespaced_service(
        api.ns,
        {"metadata": {"name": "taken"}, "spec": {"ports": [{"port": 80}], "selector": {"app": "mine"}}},
    )
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
    proc = api.k8s.kubectl(
        "wait", "-n", api.ns, "md/taken", "--for=condition=Ready", "--timeout=2s", check=False
    )
    assert proc.returncode != 0


def _engine(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "engine", **fields}]}}


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "sidecar",
        {"spec": {"containers": [{"name": "ember-sidecar", "env": [{"name": "A", "value": "1"}]}]}},
        "only the engine container ('engine') can be patched",
    ),
    ("ld-preload", _engine(env=[{"name": "LD_PRELOAD", "value": "/x.so"}]), "LD_PRELOAD, EMBER_*"),
    ("ember-env", _engine(env=[{"name": "EMBER_RUN_DIR", "value": "/x"}]), "LD_PRELOAD, EMBER_*"),
    (
        "run-dir-mount",
        _engine(volumeMounts=[{"name": "cache", "mountPath": "/var/run/ember"}]),
        "/var/run/ember",
    ),
    (
        "lib-mount",
        _engine(volumeMounts=[{"name": "cache", "mountPath": "/opt/ember/lib/x"}]),
        "/opt/ember/lib",
    ),
    ("engine-security", _engine(securityContext={"runAsUser": 0}), "the engine's securityContext"),
    ("engine-image", _engine(image="other:1"), "spec.engine.image"),
    ("engine-command", _engine(command=["python", "-m", "my_server"]),
     "the engine's command and args are ember's (`ember serve`"),
    ("engine-args", _engine(args=["--model", "other"]), "give engine arguments in spec.engine.args"),
    (
        "gpus",
        _engine(resources={"limits": {"nvidia.com/gpu": "8"}}),
        "nvidia.com/gpu comes from spec.gpu.count",
    ),
    ("pod-security", {"spec": {"securityContext": {"runAsUser": 0}}}, "the pod's securityContext"),
    ("init", {"spec": {"initContainers": [{"name": "x", "image": "x"}]}}, "initContainers: ember's"),
    ("host", {"spec": {"hostNetwork": True}}, "host namespaces"),
    ("ember-volume", {"spec": {"volumes": [{"name": "ember-run", "emptyDir": {}}]}}, "volume names ember-*"),
    ("gpu-selector", {"spec": {"nodeSelector": {"nvidia.com/gpu.product": "X"}}}, "is spec.gpu.product"),
    ("pool-label", {"metadata": {"labels": {"ember.dev/pool": "serving"}}}, "labels ember.dev/*"),
    ("managed-label", {"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}}, "labels ember.dev/*"),
    ("claim-annotation", {"metadata": {"annotations": {"ember.dev/archive": ""}}}, "annotations ember.dev/*"),
]


@pytest.mark.parametrize(("case", "template", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_admission_refuses_a_template_that_overrides_what_ember_owns(
    k8s: LocalCluster,
    minio: LocalMinio,
    crds: None,
    case: str,
    template: dict[str, Any],
    message: str,
) -> None:
    api = Api(k8s, "default")
    with pytest.raises(ApiException) as err:
        api.create_md(f"refused-{case}", md_spec(minio, "refused", template=template), dry_run=True)
    assert err.value.status == 422 and message in str(err.value.body), err.value.body


TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"example.com/owner": "search"}},
    "spec": {
        "serviceAccountName": "llm-reader",
        "imagePullSecrets": [{"name": "regcred"}],
        "nodeSelector": {"ember.test/zone": "z1"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "preference": {
                            "matchExpressions": [
                                {"key": "ember.test/zone", "operator": "In", "values": ["z1"]}
                            ]
                        },
                    }
                ]
            }
        },
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        ],
        "containers": [
            {
                "name": "engine",
                "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                "envFrom": [{"secretRef": {"name": "hf"}}],
                "volumeMounts": [
                    {"name": "model-cache", "mountPath": "/models"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
                "resources": {"requests": {"memory": "24Gi", "cpu": "3"}},
            }
        ],
    },
}


def _check_pod(spec: Any, meta: Any, container: str, priority: str) -> None:
    """What the apiserver stored for a pod (typed client objects)."""
    assert meta.labels["team"] == "search" and meta.annotations["example.com/owner"] == "search"
    assert spec.service_account_name == "llm-reader" and spec.priority_class_name == priority
    assert [s.name for s in spec.image_pull_secrets] == ["regcred"]
    assert spec.node_selector["ember.test/zone"] == "z1" and "nvidia.com/gpu.product" in spec.node_selector
    assert {t.key for t in spec.tolerations} >= {"dedicated", "nvidia.com/gpu"}
    assert spec.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution[0].weight == 1
    volumes = {v.name: v for v in spec.volumes}
    assert volumes["model-cache"].persistent_volume_claim.claim_name == "hf-cache"
    assert volumes["dshm"].empty_dir.medium == "Memory"
    engine = next(c for c in spec.containers if c.name == container)
    env = {e.name: e for e in engine.env}
    assert env["HF_TOKEN"].value_from.secret_key_ref.name == "hf" and "LD_PRELOAD" in env
    assert engine.env_from[-1].secret_ref.name == "hf"
    mounts = {m.mount_path: m.name for m in engine.volume_mounts}
    assert mounts["/models"] == "model-cache" and mounts["/dev/shm"] == "dshm"
    assert engine.resources.requests["memory"] == "24Gi" and engine.resources.requests["cpu"] == "3"
    assert engine.resources.limits["nvidia.com/gpu"] == "1"
    assert engine.security_context.read_only_root_filesystem is True


def test_template_fields_reach_save_warm_and_serving_pods(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    api.core.create_namespaced_service_account(api.ns, {"metadata": {"name": "llm-reader"}})
    priority = f"ember-test-{api.ns}"
    api.k8s.kubectl("create", "priorityclass", priority, "--value=10")
    try:
        template = {**TEMPLATE, "spec": {**TEMPLATE["spec"], "priorityClassName": priority}}
        spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 1}, template=template)
        api.create_md("tpl", spec)
        job = wait_for(lambda: next(iter(api.jobs()), None), "the SAVE Job", op)
        _check_pod(job.spec.template.spec, job.spec.template.metadata, "save", priority)
        save = job.spec.template.spec.containers[0].resources
        assert save.requests == {"cpu": "3", "memory": "24Gi"}  # not BestEffort
        write_test_archive(minio, prefix, spec)
        pod = wait_for(lambda: next(iter(api.serving("tpl")), None), "the serving pod", op)
        _check_pod(pod.spec, pod.metadata, "engine", priority)
        warm = wait_for(lambda: next(iter(api.warm()), None), "the warm pod", op)
        _check_pod(warm.spec, warm.metadata, "engine", priority)
    finally:
        api.k8s.kubectl("delete", "priorityclass", priority, "--ignore-not-found")


def test_graph_arguments_and_a_pinned_image_name_new_archives(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    # vLLM's arguments: which change graphs (ember.identity_args), which do not
    api.create_md("ids", md_spec(minio, prefix, replicas=0, engine={
        "kind": "vllm", "version": "0.26.0", "image": "registry.invalid/ember/engine:test"}))

    def archive_after(generation: int) -> str:
        def seen() -> str:
            st = api.md("ids").get("status") or {}
            return st.get("observedGeneration", 0) >= generation and (st.get("archive") or {}).get("name")

        return str(wait_for(seen, f"generation {generation} observed", op))

    first = archive_after(1)
    port = api.patch_md("ids", {"spec": {"engine": {"args": ["--port", "9000", "--disable-log-stats"]}}})
    assert archive_after(port["metadata"]["generation"]) == first  # front-end flags: same graphs
    kv = api.patch_md("ids", {"spec": {"engine": {"args": ["--kv-cache-dtype", "fp8", "--port", "9000"]}}})
    second = archive_after(kv["metadata"]["generation"])
    assert second != first
    ga = wait_for(lambda: api.archive(second), "the new GraphArchive", op)
    assert ga["spec"]["identity"]["engineArgs"] == ["--kv-cache-dtype", "fp8"]
    digest = "sha256:" + "ab" * 32
    pinned = api.patch_md("ids", {"spec": {"engine": {"image": f"registry.invalid/ember/engine@{digest}"}}})
    third = archive_after(pinned["metadata"]["generation"])
    assert third not in (first, second)
    assert (
        wait_for(lambda: api.archive(third), "the pinned image's archive", op)["spec"]["identity"][
            "imageDigest"
        ]
        == digest
    )
