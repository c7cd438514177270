"""Pod, SAVE Job and HPA builders: the manifests carry the protocol and the security posture."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_helpers import CTX, md_spec

from ember import contract
from ember.contract import Claim
from ember.identity import canonical_json
from ember_operator import naming
from ember_operator.api import AutoscalingSpec, GraphArchiveSpec
from ember_operator.hpas import hpa
from ember_operator.jobs import job_state, read_termination, save_job
from ember_operator.planning import archive_object, claim_for, revision_of, template_of
from ember_operator.pods import StoreAccess, bound_key, bound_warm_pod, claim_patch, serving_pod, warm_pod
from ember_operator.services import address, service


def _claim() -> Claim:
    ident = md_spec().identity()
    return Claim(deployment="qwen", identity=ident.hash(),
                 identity_spec=canonical_json(ident.canonical()).decode(), revision="abc123",
                 archive_uri="s3://ember/ember/archives/x/manifest", engine_args=("--x", "1"))


def test_serving_pod_has_native_sidecar_lib_and_protocol() -> None:
    t = template_of("default", md_spec(), CTX)
    pod = serving_pod(t, _claim(), "qwen-abc-0", "u")
    spec = pod["spec"]
    inits = {c["name"]: c for c in spec["initContainers"]}
    assert [c["name"] for c in spec["initContainers"]] == ["ember-lib", "ember-sidecar"]
    assert inits["ember-sidecar"]["restartPolicy"] == "Always"
    assert "restartPolicy" not in inits["ember-lib"]
    engine = spec["containers"][0]
    env = {e["name"]: e for e in engine["env"]}
    assert env["LD_PRELOAD"]["value"] == "/opt/ember/lib/libember.so"
    assert env["EMBER_RUN_DIR"]["value"] == "/var/run/ember"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert {"/opt/ember/lib", "/var/run/ember", "/etc/ember/podinfo"} <= mounts
    side_env = {e["name"]: e.get("value") for e in inits["ember-sidecar"]["env"]}
    assert side_env["EMBER_STORE"] == "s3://ember/ember"
    assert side_env["EMBER_S3_ENDPOINT"] == "http://127.0.0.1:19000"
    assert inits["ember-sidecar"]["envFrom"] == [{"secretRef": {"name": "s3", "optional": True}}]
    meta = pod["metadata"]
    assert meta["labels"][contract.LABEL_POOL] == "serving"
    assert meta["labels"][contract.LABEL_DEPLOYMENT] == "qwen"
    assert meta["annotations"][contract.ANN_ARCHIVE].endswith("/manifest")
    assert json.loads(meta["annotations"][contract.ANN_ENGINE_ARGS]) == ["--x", "1"]
    assert meta["ownerReferences"][0]["kind"] == "ModelDeployment"
    assert meta["ownerReferences"][0]["uid"] == "u"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_pods_are_restricted() -> None:
    t = template_of("default", md_spec(), CTX)
    spec = warm_pod(t)["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["initContainers"] + spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "ember-sidecar")
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert not any("hostPath" in v for v in spec["volumes"])


def test_warm_pod_is_unclaimed_and_claim_patch_is_conditional() -> None:
    t = template_of("default", md_spec(), CTX)
    pod = warm_pod(t)
    assert pod["metadata"]["labels"][contract.LABEL_POOL] == "warm"
    assert contract.LABEL_DEPLOYMENT not in pod["metadata"]["labels"]
    assert pod["metadata"]["generateName"].startswith("ember-warm-")
    patch = claim_patch(_claim(), "42", "u")
    assert patch["metadata"]["resourceVersion"] == "42"
    assert patch["metadata"]["labels"][contract.LABEL_POOL] == "serving"
    assert patch["metadata"]["annotations"][contract.ANN_IDENTITY] == _claim().identity


VLLM = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test"}


def test_vllm_pool_key_depends_on_gpu_engine_and_store_not_model() -> None:
    a = template_of("default", md_spec(engine=VLLM), CTX).pool_key
    b = template_of("default", md_spec(engine=VLLM, model={"name": "other/model"}), CTX).pool_key
    c = template_of("default", md_spec(engine=VLLM, gpu={"product": "NVIDIA-H200"}), CTX).pool_key
    d = template_of("default", md_spec(engine={**VLLM, "args": ["--enforce-eager"]}), CTX).pool_key
    assert a == b == d and a != c  # its pods learn model and arguments with the claim


def test_vllm_pool_keys_names_and_revisions_are_those_of_before_transformers_commands() -> None:
    """Pinned (computed by the operator before transformers pods ran `ember serve`): an upgrade
    keeps every vLLM pool's template key and warm pod names. What follows the identity changes
    only where the archive must: a vLLM identity now names Inductor's deterministic mode and
    rank-invariant compiled code and the kind of LOAD's canary (args.IDENTITY_WORKLOAD), so an
    archive compiled otherwise or checked by another canary is SAVEd again, and the claim's engine
    arguments carry the mode (args.NUMERICS). The canary's kind last changed when its FULL
    step began to write and read real KV slots (`vllm-steps-kv`)."""
    spec = md_spec(engine={**VLLM, "args": ["--enforce-eager"]})
    t = template_of("default", spec, CTX)
    claim = claim_for("qwen", spec, None, "NoArchive")
    assert t.serve_args == () and t.pool_key == "c80506fb992dc4b4"
    assert bound_key(t.pool_key, "qwen", claim) == "55d1bf5616909892"
    assert revision_of(spec.identity().hash(), t, spec) == "61b57a6543"
    assert warm_pod(t, name=naming.warm_pod_names(t.pool_key, set(), 1)[0])["metadata"]["name"] == (
        "ember-warm-c80506fb99-0")


def test_transformers_pool_key_holds_the_model_and_the_engine_args() -> None:
    """A transformers pod runs its model from its creation (its command): a template-keyed pool
    serves one model and one set of `ember serve` arguments only."""
    def key(**over: Any) -> str:
        return template_of("default", md_spec(**over), CTX).pool_key

    base = {"kind": "transformers", "version": "5.17", "image": "engine:test"}
    keys = [key(engine=base), key(engine=base, model={"name": "other/model"}),
            key(engine={**base, "args": ["--layers", "2"]}), key(engine={**base, "args": ["--layers", "3"]}),
            key(engine={**base, "args": ["--model", "tiny-llama"]})]
    assert len(set(keys)) == len(keys)
    assert key(engine=base) == key(engine=base, replicas=7)


def test_save_job_runs_on_one_gpu_of_the_product() -> None:
    spec = md_spec(parallelism={"data": 2}, gpu={"product": "NVIDIA-H100-80GB-HBM3", "count": 2})
    ga = archive_object("ga-x", "default", spec, CTX)
    ga_spec = GraphArchiveSpec.model_validate(ga["spec"])
    ident = spec.identity()
    name = naming.save_job_name(ident.hash(), 0)
    job = save_job(name=name, namespace="default", archive_name="ga-x", archive_uid="u", spec=ga_spec,
                   store=StoreAccess.of(ga_spec.store), sidecar_image="ember:test", timeout_seconds=600,
                   attempt=0)
    assert job["metadata"]["name"] == f"ember-save-{ident.hash()[:16]}-0"
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["ember", "save", "--job", "--"]  # the engine's arguments follow
    assert c["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": "1"}  # 1 GPU, any shape
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "16Gi"}  # never BestEffort
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["EMBER_IDENTITY"] == canonical_json(ident.canonical()).decode()
    assert env["EMBER_STORE"] == "s3://ember/ember"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert c["envFrom"] == [{"secretRef": {"name": "s3", "optional": False}}]
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"


def test_termination_message_is_parsed() -> None:
    summary = {"manifest_digest": "ab" * 32, "bytes": 1234, "graphs": 4, "durations": {"capture": 1.5}}
    pod = {"status": {"containerStatuses": [{"name": "save", "state": {"terminated": {
        "exitCode": 0, "message": json.dumps(summary)}}}]}}
    result = read_termination(pod)
    assert result is not None and result.succeeded and result.bytes == 1234 and result.graphs == 4
    assert result.durations == {"capture": 1.5}
    failed = {"status": {"containerStatuses": [{"name": "save", "state": {"terminated": {
        "exitCode": 3, "message": "loading model\nCUDA out of memory"}}}]}}
    r2 = read_termination(failed)
    assert r2 is not None and not r2.succeeded and r2.reason == "CUDA out of memory"
    running = {"status": {"containerStatuses": [{"name": "save", "state": {"running": {}}}]}}
    assert read_termination(running) is None


def test_job_state_from_conditions() -> None:
    assert job_state({}) == "Active"
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "Succeeded"
    assert job_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "Failed"


def test_hpa_targets_the_scale_subresource() -> None:
    spec = AutoscalingSpec.model_validate({"minReplicas": 2, "maxReplicas": 9, "targets": [
        {"type": "Resource", "name": "cpu", "averageUtilization": 70},
        {"type": "Pods", "name": "vllm_num_requests_running", "averageValue": "8"},
    ]})
    h = hpa(md_name="qwen", md_uid="u", namespace="default", spec=spec)
    assert h["spec"]["scaleTargetRef"] == {"apiVersion": "ember.dev/v1alpha1", "kind": "ModelDeployment",
                                           "name": "qwen"}
    assert h["spec"]["minReplicas"] == 2 and h["spec"]["maxReplicas"] == 9
    assert h["spec"]["metrics"][0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    assert h["spec"]["metrics"][1]["pods"]["metric"] == {"name": "vllm_num_requests_running"}


def test_hpa_without_targets_accepts_apiserver_defaults() -> None:
    from ember_operator.hpas import needs_update

    spec = AutoscalingSpec.model_validate({"minReplicas": 1, "maxReplicas": 3})
    desired = hpa(md_name="qwen", md_uid="u", namespace="default", spec=spec)
    stored = {"spec": {**desired["spec"], "metrics": [{"type": "Resource", "resource": {"name": "cpu"}}]}}
    assert not needs_update(stored, desired)
    assert needs_update({"spec": {**desired["spec"], "maxReplicas": 9}}, desired)


def test_status_merge_patch_removes_vanished_fields() -> None:
    from ember_operator.kube import merge_patch

    old = {"phase": "Failed", "failureReason": "x", "archive": {"uri": "u", "name": "n"}}
    new = {"phase": "Available", "archive": {"name": "n"}}
    assert merge_patch(old, new) == {"phase": "Available", "failureReason": None,
                                     "archive": {"name": "n", "uri": None}}


def test_vllm_pods_supervise_vllm_serve_and_the_claim_names_the_model() -> None:
    """engine.kind vllm: the engine container runs `ember serve --engine vllm` (it waits for the
    hand-off, then starts `vllm serve` with the claim's arguments); the claim carries the model
    first (a warm pod learns it only then) with everything else the SAVE Job ran vLLM with, then
    engine.args."""
    from ember.engines.vllm import args as vllm_args
    from ember_operator.planning import engine_args

    vllm = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test", "args": ["--enforce-eager"]}
    spec = md_spec(engine=vllm)
    engine = serving_pod(template_of("default", spec, CTX), _claim(), "p", "u")["spec"]["containers"][0]
    assert engine["command"][:4] == ["ember", "serve", "--engine", "vllm"]
    assert engine["command"][engine["command"].index("--") + 1:] == ["--host", "0.0.0.0", "--port", "8000"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env[contract.ENV_ENGINE] == "vllm"
    # The identity's arguments (what the SAVE Job ran), then the deployment's own.
    args = engine_args(spec)
    assert args == (*vllm_args.engine_args(spec.identity()), "--enforce-eager")
    assert args[:6] == ("--model", "Qwen/Qwen3-0.6B", "--revision", "main", "--dtype", "bfloat16")
    cc = json.loads(args[args.index("--compilation-config") + 1])
    assert cc["cudagraph_capture_sizes"] == list(spec.capture.resolved_sizes())
    assert args[args.index("--max-num-seqs") + 1] == str(spec.capture.max_batch)


@pytest.mark.parametrize(("args", "model_args"), [
    ([], ["--model", "Qwen/Qwen3-0.6B"]),
    (["--layers", "2", "--num-blocks", "32"], ["--model", "Qwen/Qwen3-0.6B"]),
    (["--model", "tiny-llama", "--layers", "2"], []),  # engine.args name the model: not model.name
    (["--model-config", "/models/shape.json"], []),
])
def test_transformers_pods_run_ember_serve_with_the_model_and_engine_args(
    args: list[str], model_args: list[str]
) -> None:
    """Cold, template-keyed warm, identity-keyed warm and claimed pods alike: `ember serve` behind
    the hand-off on the engine port, with the model and engine.args; the claim carries the same."""
    from ember_operator.planning import engine_args

    spec = md_spec(engine={"kind": "transformers", "version": "5.17", "image": "engine:test", "args": args},
                   warmPool={"size": 1})
    t = template_of("default", spec, CTX)
    want = ["ember", "serve", "--run-dir", "/var/run/ember", "--host", "0.0.0.0", "--port", "8000",
            *model_args, *args]
    claim = claim_for("qwen", spec, None, "NoArchive")
    pods = [serving_pod(t, claim, "p", "u"), warm_pod(t), bound_warm_pod(t, claim, "qwen", "u", "w")]
    for pod in pods:
        engine = pod["spec"]["containers"][0]
        assert engine["command"] == want and "args" not in engine
    assert list(claim.engine_args) == list(engine_args(spec)) == want[8:]
    # a claim patch changes no command: the warm pod was made for these arguments (its pool key)
    assert "spec" not in claim_patch(claim, "1", "u")
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_ENGINE] == "transformers"


def test_the_service_selects_the_deployments_serving_pods_on_the_engine_port() -> None:
    t = template_of("default", md_spec(), CTX)
    pod = serving_pod(t, _claim(), "qwen-abc-0", "u")
    engine = pod["spec"]["containers"][0]
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    svc = service("qwen", "default", "u")
    selector = svc["spec"]["selector"]
    assert selector == {"ember.dev/deployment": "qwen", "ember.dev/pool": "serving"}
    assert all(pod["metadata"]["labels"][k] == v for k, v in selector.items())
    assert svc["spec"]["ports"][0]["targetPort"] == engine["ports"][0]["containerPort"]
    warm = warm_pod(t, name="ember-warm-x-0")["metadata"]["labels"]
    assert not all(warm.get(k) == v for k, v in selector.items())
    owner = svc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ModelDeployment", "qwen", "u")
    assert owner["controller"] is True
    assert address("qwen", "team-a") == "qwen.team-a.svc:8000"
