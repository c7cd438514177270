"""The operator against the real local control plane (kwok GPU nodes) and MinIO.

Covers the issue's k8s tier: every phase of the example deployment, the SAVE Job's GPU request
and placement, serving pods with the native sidecar after the archive lands in MinIO, one
archive and one Job for two deployments of one identity, /scale (kubectl scale and an HPA),
warm pods claimed first, and a SIGKILLed operator converging without duplicates.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import watch
from operator_harness import (
    GROUP,
    PRODUCT,
    TEST_PRODUCT,
    VERSION,
    Api,
    OperatorProcess,
    identity_of,
    md_spec,
    operator_env,
    phase,
    play_ready_engines,
    wait_for,
    write_test_archive,
)
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3, pytest.mark.slow]


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "op") as env:
        yield env


def _record_phases(api: Api, name: str, stop: threading.Event) -> list[str]:
    phases: list[str] = []

    def run() -> None:
        w = watch.Watch()
        for event in w.stream(api.custom.list_namespaced_custom_object, GROUP, VERSION, api.ns,
                              "modeldeployments", field_selector=f"metadata.name={name}",
                              timeout_seconds=120):
            p = (event["object"].get("status") or {}).get("phase")
            if p and (not phases or phases[-1] != p):
                phases.append(p)
            if stop.is_set():
                w.stop()

    threading.Thread(target=run, daemon=True).start()
    return phases


def test_example_goes_through_every_phase(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    summary = {"manifest_digest": "0" * 64, "bytes": 1, "graphs": 4,
               "durations": {"capture": 12.5, "upload": 0.8}}
    spec = md_spec(minio, prefix, product=PRODUCT, save={"podAnnotations": {
        "pod-complete.stage.kwok.x-k8s.io/delay": "4s",
        "kwok.ember.dev/termination-message": json.dumps(summary),  # what `ember save --job` reports
    }})
    stop = threading.Event()
    phases = _record_phases(api, "qwen", stop)
    api.create_md("qwen", spec)
    ident = identity_of(spec)

    job = wait_for(lambda: next(iter(api.jobs()), None), "the SAVE Job", op)
    assert job.metadata.name == f"ember-save-{ident.hash()[:16]}-0"
    pod_spec = job.spec.template.spec
    container = pod_spec.containers[0]
    assert container.resources.limits == {"nvidia.com/gpu": "1", "memory": "16Gi"}
    assert container.resources.requests == {"cpu": "2", "memory": "16Gi"}  # never BestEffort
    assert pod_spec.node_selector == {"nvidia.com/gpu.product": PRODUCT}
    assert any(t.key == "nvidia.com/gpu" for t in pod_spec.tolerations)
    job_env = {e.name: e.value for e in container.env}
    assert json.loads(job_env["EMBER_IDENTITY"]) == ident.canonical()
    assert job_env["EMBER_STORE"] == f"s3://{minio.bucket}/{prefix}"
    wait_for(lambda: phase(api, "qwen") == "Saving", "phase Saving", op)
    assert api.serving("qwen") == []

    # The SAVE "runs": the test writes the archive as `ember save --job` would; kwok completes the pod.
    write_test_archive(minio, prefix, spec)
    ga = wait_for(lambda: (a := api.archive(f"ga-{ident.hash()[:16]}")) and
                  (a.get("status") or {}).get("phase") == "Available" and a, "GraphArchive Available", op)
    assert ga["status"]["uri"].endswith(f"/archives/{ident.hash()}/manifest")
    assert ga["status"]["bytes"] > 0 and ga["status"]["graphs"] == 4
    ga = wait_for(lambda: (a := api.archive(ga["metadata"]["name"]))["status"].get("durations") and a,
                  "SAVE durations from the termination message", op)
    assert ga["status"]["durations"] == {"capture": 12.5, "upload": 0.8}

    pods = wait_for(lambda: len(p := api.serving("qwen")) == 2 and p, "two serving pods", op)
    for pod in pods:
        inits = {c.name: c for c in pod.spec.init_containers}
        assert inits["ember-sidecar"].restart_policy == "Always"
        assert "ember-lib" in inits
        engine = pod.spec.containers[0]
        env_vars = {e.name: e.value for e in engine.env}
        assert env_vars["LD_PRELOAD"] == "/opt/ember/lib/libember.so"
        assert env_vars["EMBER_RUN_DIR"] == "/var/run/ember"
        assert {v.name for v in pod.spec.volumes} >= {"ember-lib", "ember-run", "ember-podinfo"}
        assert pod.metadata.annotations["ember.dev/archive"] == ga["status"]["uri"]
        assert pod.metadata.annotations["ember.dev/identity"] == ident.hash()
        assert pod.spec.security_context.run_as_non_root is True
    wait_for(lambda: phase(api, "qwen") == "Ready", "phase Ready", op)
    stop.set()
    md = api.md("qwen")
    assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
    assert md["status"]["readyReplicas"] == 2
    assert all(c["observedGeneration"] == md["metadata"]["generation"] for c in md["status"]["conditions"])
    assert {"Ready", "ArchiveReady", "Available", "Progressing", "Schedulable"} == {
        c["type"] for c in md["status"]["conditions"]}
    for expected in ("Pending", "Saving", "Deploying", "Ready"):
        assert expected in phases, f"phase {expected} never seen in {phases}"
    assert phases.index("Saving") < phases.index("Deploying") < phases.index("Ready")
    # the events are posted after the status that says Ready: wait for them too
    wait_for(lambda: {"Phase", "ArchiveAvailable"} <= {e["reason"] for e in api.events_for("qwen")},
             "the Phase and ArchiveAvailable events", op)
    # Prometheus metrics on the metrics port.
    text = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
    assert 'ember_saves_total{result="succeeded"} 1.0' in text
    assert 'ember_reconcile_seconds_count{kind="ModelDeployment"}' in text
    assert "ember_save_seconds_count 1.0" in text


def test_same_identity_shares_one_archive_and_one_job(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, save={"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}})
    api.create_md("a", spec)
    api.create_md("b", {**spec, "replicas": 1})
    wait_for(lambda: phase(api, "a") == "Saving" and phase(api, "b") == "Saving", "both Saving", op)
    assert len(api.archives()) == 1
    assert len(api.jobs()) == 1
    write_test_archive(minio, prefix, spec)
    wait_for(lambda: len(api.serving("a")) == 2 and len(api.serving("b")) == 1, "pods of both", op)
    assert len(api.archives()) == 1 and len(api.jobs()) == 1


def test_scale_hpa_and_warm_claims(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    play_ready_engines(api)
    spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 2})
    write_test_archive(minio, prefix, spec)  # archive already in the store: no SAVE Job at all
    api.create_md("qwen", spec)
    wait_for(lambda: phase(api, "qwen") == "Ready", "Ready", op)
    assert api.jobs() == []
    warm = wait_for(lambda: len(w := api.claimable()) == 2 and w, "two warm pods with a ready engine", op)
    warm_names = {p.metadata.name for p in warm}

    api.k8s.kubectl("scale", "-n", api.ns, "md/qwen", "--replicas=4")
    pods = wait_for(lambda: len(p := api.serving("qwen")) == 4 and p, "4 serving pods", op)
    names = {p.metadata.name for p in pods}
    assert warm_names <= names, "warm pods were not claimed first"
    claimed = [p for p in pods if p.metadata.name in warm_names]
    for pod in claimed:
        assert pod.metadata.labels["ember.dev/pool"] == "serving"
        assert pod.metadata.annotations["ember.dev/archive"].endswith("/manifest")
        assert pod.metadata.owner_references[0].kind == "ModelDeployment"
    # The pool is replenished.
    wait_for(lambda: len(api.warm()) == 2, "warm pool replenished", op)
    md = wait_for(lambda: (m := api.md("qwen"))["status"].get("readyReplicas") == 4 and m, "4 ready", op)
    assert md["status"]["warmClaims"] >= 2
    scale = api.custom.get_namespaced_custom_object_scale(GROUP, VERSION, api.ns, "modeldeployments", "qwen")
    assert scale["spec"]["replicas"] == 4 and scale["status"]["replicas"] == 4
    assert scale["status"]["selector"] == "ember.dev/deployment=qwen,ember.dev/pool=serving"

    # Scale down through the scale subresource.
    api.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, api.ns, "modeldeployments", "qwen",
                                                    {"spec": {"replicas": 2}})
    wait_for(lambda: len(api.serving("qwen")) == 2, "2 serving pods", op)

    # An HPA (created by the operator from spec.autoscaling) moves the pods through /scale.
    api.patch_md("qwen", {"spec": {"autoscaling": {"minReplicas": 5, "maxReplicas": 6}}})
    hpa = wait_for(lambda: next(iter(api.hpa.list_namespaced_horizontal_pod_autoscaler(api.ns).items), None),
                   "the HPA", op)
    assert hpa.spec.scale_target_ref.kind == "ModelDeployment" and hpa.spec.min_replicas == 5
    wait_for(lambda: api.md("qwen")["spec"]["replicas"] == 5, "HPA scaled spec.replicas to 5", op, timeout=90)
    wait_for(lambda: len(api.serving("qwen")) == 5, "5 serving pods", op)
    # Removing the block removes the HPA.
    api.patch_md("qwen", {"spec": {"autoscaling": None}})
    wait_for(lambda: not api.hpa.list_namespaced_horizontal_pod_autoscaler(api.ns).items, "HPA deleted", op)

    # Deleting the deployment cleans up its pods (finalizer).
    api.delete_md("qwen")
    wait_for(lambda: not api.serving("qwen"), "pods cleaned up", op)


def test_parallelism_edit_resaves_and_rolls(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    write_test_archive(minio, prefix, spec)
    api.create_md("moe", spec)
    wait_for(lambda: phase(api, "moe") == "Ready", "Ready", op)
    old = {p.metadata.name for p in api.serving("moe")}
    new_spec = {**spec, "parallelism": {"data": 2, "expert": 2},
                "gpu": {"product": TEST_PRODUCT, "count": 2},
                "save": {"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}}
    api.patch_md("moe", {"spec": {"parallelism": new_spec["parallelism"], "gpu": new_spec["gpu"],
                                  "save": new_spec["save"]}})
    wait_for(lambda: phase(api, "moe") == "Reconfiguring", "Reconfiguring", op)
    new_ident = identity_of(new_spec)
    job = wait_for(lambda: next((j for j in api.jobs() if new_ident.hash()[:16] in j.metadata.name), None),
                   "SAVE Job of the new identity", op)
    assert job.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    assert {p.metadata.name for p in api.serving("moe")} == old, "old pods must keep serving during SAVE"
    assert "SAVE running" in api.condition("moe", "Progressing")["message"]
    write_test_archive(minio, prefix, new_spec)
    wait_for(lambda: phase(api, "moe") == "Ready"
             and not (old & {p.metadata.name for p in api.serving("moe")}),
             "pods moved to the new identity", op, timeout=90)
    pods = api.serving("moe")
    assert len(pods) == 2
    for pod in pods:
        assert pod.metadata.annotations["ember.dev/identity"] == new_ident.hash()
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"


def test_sigkill_during_reconcile_converges_without_duplicates(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=30,
                   save={"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}})
    api.create_md("big", spec)
    wait_for(lambda: api.jobs(), "SAVE Job", op)
    op.kill()
    op.start()  # restarted: finds the Job by its deterministic name
    wait_for(lambda: phase(api, "big") == "Saving", "Saving after restart", op)
    assert len(api.jobs()) == 1
    write_test_archive(minio, prefix, spec)
    # Kill while pods are being created.
    wait_for(lambda: len(api.serving("big")) > 0, "first pods", op, interval=0.02)
    op.kill()
    partial = len(api.serving("big"))
    op.start()
    wait_for(lambda: len(api.serving("big")) == 30 and phase(api, "big") == "Ready", "30 pods, Ready", op,
             timeout=120)
    names = [p.metadata.name for p in api.serving("big")]
    assert len(names) == len(set(names)) == 30
    assert len(api.jobs()) == 1 and len(api.archives()) == 1
    print(f"killed with {partial}/30 pods created; converged to 30")


def test_examples_apply_and_become_ready(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Every manifest in examples/ is applied as a user would; each deployment ends Ready once its
    archive is in the store (written here as `ember save --job` would: kwok has no GPU)."""
    import yaml
    from operator_harness import COMPAT, REPO

    from ember.archive.bundle import write_archive
    from ember.store import open_store
    from ember_operator.api import GraphArchiveSpec
    from ember_testing.cluster import kubectl_apply
    from ember_testing.synthetic import synthetic_graphset, synthetic_images

    env = {**minio.env, "EMBER_OPERATOR_MANIFEST_GRACE_SECONDS": "60",
           "EMBER_OPERATOR_LOCAL_STORE_ROOT": str(tmp_path)}  # the local example's store
    with operator_env(k8s, minio, tmp_path, "ex", env) as (api, op, prefix):
        ns = api.ns
        # As a user applies them, but on this test's own store keys and GPU nodes: the demo
        # (e2e/demo.sh) may be running the same examples (same identities) on the cluster's H100s.
        for path in sorted((REPO / "examples").glob("*.yaml")):
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
            for doc in docs:
                doc.setdefault("metadata", {})["namespace"] = ns
                if doc.get("kind") == "ModelDeployment":
                    _own_store_and_nodes(doc["spec"], prefix, tmp_path)
            kubectl_apply(str(k8s.kubeconfig), docs)
        names = [m["metadata"]["name"] for m in api.custom.list_namespaced_custom_object(
            GROUP, VERSION, ns, "modeldeployments")["items"]]
        assert len(names) == 3
        # One per deployment, and one for qwen-moe's alternative shape (saved ahead of a switch).
        wait_for(lambda: len(api.archives()) == 4, "four GraphArchives", op)
        for ga in api.archives():
            spec = GraphArchiveSpec.model_validate(ga["spec"])
            opts = {"endpoint": minio.endpoint, "access_key": minio.access_key,
                    "secret_key": minio.secret_key} if spec.store.s3 else {}
            write_archive(open_store(spec.store.uri(), **opts),
                          synthetic_graphset(graphs=2, nodes=20, groups=1),
                          spec.identity.to_identity(), COMPAT, kernel_images=synthetic_images())
        for name in names:
            wait_for(lambda n=name: phase(api, n) == "Ready", f"{name} Ready", op, timeout=120)
        # The external HPA (examples/hpa-external.yaml) holds qwen-s3 at its minReplicas (2).
        assert api.md("qwen-s3")["spec"]["replicas"] >= 2


def _own_store_and_nodes(spec: dict[str, Any], prefix: str, root: Path) -> None:
    from operator_harness import TEST_PRODUCT

    spec["gpu"]["product"] = TEST_PRODUCT
    store = spec.get("store") or {}
    if "s3" in store:
        store["s3"]["prefix"] = prefix
    if "local" in store:
        store["local"]["path"] = str(root / "local-store")


def test_unreferenced_archive_is_garbage_collected(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    with operator_env(k8s, minio, tmp_path, "gc", {"EMBER_OPERATOR_ARCHIVE_RETENTION_SECONDS": "3"}) as (
        api, op, prefix,
    ):
        spec = md_spec(minio, prefix, replicas=1)
        write_test_archive(minio, prefix, spec)
        api.create_md("short", spec)
        wait_for(lambda: phase(api, "short") == "Ready", "Ready", op)
        assert len(api.archives()) == 1
        api.delete_md("short")
        wait_for(lambda: not api.serving("short"), "pods cleaned up by the finalizer", op)
        wait_for(lambda: not api.archives(), "GraphArchive garbage-collected after retention", op, timeout=60)
