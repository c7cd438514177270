"""Issue 38: the operator under adversarial use, on the local control plane (real scheduler, kwok
GPU nodes, MinIO). Status never says Ready when pods cannot run, warm pods give GPUs back, specs
the operator refuses get a status, tenants cannot borrow the operator's credentials or network
position, and sizes are capped.

Each test's GPU nodes carry a product of its own (`_nodes`), so "the cluster is full" is exact and
no other test's pods compete for them.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    Api,
    OperatorProcess,
    chart_objects,
    ensure_priority_class,
    identity_of,
    md_spec,
    operator_env,
    phase,
    play_ready_engines,
    refusal,
    wait_for,
    write_test_archive,
)
from support.cluster import LocalCluster, LocalMinio

from ember_testing.cluster import fake_gpu_nodes, kubectl_apply

pytestmark = [pytest.mark.k8s, pytest.mark.s3]
WARM_CLASS = "ember-warm-test"  # the chart's ember-warm, as the tests make it


@pytest.fixture
def nodes(k8s: LocalCluster) -> Iterator[Any]:
    """`make(gpus)`: one kwok node of `gpus` GPUs of a product only this test uses; its name."""
    made: list[str] = []

    def make(gpus: int) -> str:
        product = f"NVIDIA-EMBER-ADV-{uuid.uuid4().hex[:8]}"
        node = fake_gpu_nodes(f"ember-adv-{product[-8:].lower()}", product, count=1, gpus=gpus)
        kubectl_apply(str(k8s.kubeconfig), node)
        made.append(node[0]["metadata"]["name"])
        return product

    yield make
    for name in made:
        k8s.kubectl("delete", "node", name, "--wait=false", check=False)


def _env(k8s: LocalCluster, minio: LocalMinio, tmp_path: Path, name: str, **settings: str) -> Any:
    return operator_env(k8s, minio, tmp_path, name, env={f"EMBER_OPERATOR_{k.upper()}": v
                                                          for k, v in settings.items()})


def _events(api: Api, name: str) -> dict[str, str]:
    return {e["reason"]: e.get("message") or e.get("note") or "" for e in api.events_for(name)}


def _reasons(api: Api, name: str) -> dict[str, str]:
    conds = (api.md(name).get("status") or {}).get("conditions") or []
    return {c["type"]: c.get("reason", "") for c in conds}


def test_pods_that_cannot_be_scheduled_are_named_and_never_ready(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path, nodes: Any,
) -> None:
    """Item 1: a 16-GPU replica on an 8-GPU node stays Pending: Schedulable=False names the pod
    with the scheduler's message, an event says it, Progressing says it is stuck, never Ready;
    and warm pods of the deployment that cannot be placed are named too."""
    product = nodes(8)
    with _env(k8s, minio, tmp_path, "adv-sched") as (api, op, prefix):
        spec = md_spec(minio, prefix, product=product, replicas=1, parallelism={"tensor": 16})
        write_test_archive(minio, prefix, spec)
        api.create_md("wide", spec)
        cond = wait_for(lambda: (c := api.condition("wide", "Schedulable")).get("status") == "False" and c,
                        "Schedulable=False", op)
        pod = api.serving("wide")[0].metadata.name
        assert cond["reason"] == "PodsUnschedulable", cond
        assert pod in cond["message"] and "Insufficient nvidia.com/gpu" in cond["message"], cond
        assert "stuck: 1 new pod(s) cannot be scheduled" in api.condition("wide", "Progressing")["message"]
        wait_for(lambda: "PodsUnschedulable" in _events(api, "wide"), "a PodsUnschedulable event", op)
        assert phase(api, "wide") != "Ready"

        # Warm pods of a pool that does not fit: 3 × 4 GPUs asked for on an 8-GPU node (another
        # product: the pending 16-GPU pod holds its own product's pools back).
        warm = md_spec(minio, prefix, product=nodes(8), replicas=0, parallelism={"tensor": 4},
                       warmPool={"size": 12})
        api.create_md("warm", warm)
        cond = wait_for(lambda: (c := api.condition("warm", "Schedulable")).get("reason")
                        == "WarmPodsUnschedulable" and c, "WarmPodsUnschedulable", op, timeout=60)
        assert "1 warm pod(s) cannot be scheduled" in cond["message"], cond
        assert phase(api, "warm") != "Ready"


def test_warm_pods_give_their_gpus_to_a_serving_pod_of_a_full_cluster(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path, nodes: Any,
) -> None:
    """Item 2: 8 idle 1-GPU warm pods fill the node; a 4-GPU serving pod of another deployment
    then gets 4 of their GPUs (the operator deletes them) instead of staying Pending."""
    product = nodes(8)
    with _env(k8s, minio, tmp_path, "adv-yield") as (api, op, prefix):
        idle = md_spec(minio, prefix, product=product, replicas=0, warmPool={"size": 8})
        write_test_archive(minio, prefix, idle)  # no SAVE Job: its pod would take a GPU
        api.create_md("idle", idle)
        wait_for(lambda: sum(bool(p.spec.node_name) for p in api.warm()) == 8, "8 warm pods placed", op)
        serving = md_spec(minio, prefix, product=product, replicas=1, parallelism={"tensor": 4})
        write_test_archive(minio, prefix, serving)
        api.create_md("serving", serving)
        wait_for(lambda: phase(api, "serving") == "Ready", "the 4-GPU pod runs", op, timeout=90)
        assert "WarmPodsYielded" in _events(api, "serving")
        placed = [p for p in api.warm() if p.spec.node_name]
        assert len(placed) == 4, [p.metadata.name for p in api.warm()]


def test_the_scheduler_preempts_low_priority_warm_pods_for_a_serving_pod(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path, nodes: Any,
) -> None:
    """Item 2, by the scheduler: warm pods run at the chart's low PriorityClass, so with the node
    full of another deployment's idle warm pods the real kube-scheduler preempts 4 of them for a
    4-GPU serving pod (default priority; `Preempted` events on the warm pods) in its own
    scheduling cycle, and the operator yields none on top (the pod has a nominated node)."""
    ensure_priority_class(k8s, WARM_CLASS)
    product = nodes(8)
    with _env(k8s, minio, tmp_path, "adv-preempt", warm_priority_class=WARM_CLASS) as (api, op, prefix):
        idle = md_spec(minio, prefix, product=product, replicas=0, warmPool={"size": 8})
        write_test_archive(minio, prefix, idle)
        api.create_md("idle", idle)
        wait_for(lambda: sum(bool(p.spec.node_name) for p in api.warm()) == 8, "8 warm pods placed", op)
        assert {(p.spec.priority_class_name, p.spec.priority) for p in api.warm()} == {(WARM_CLASS, -10)}
        serving = md_spec(minio, prefix, product=product, replicas=1, parallelism={"tensor": 4})
        write_test_archive(minio, prefix, serving)
        api.create_md("serving", serving)
        wait_for(lambda: phase(api, "serving") == "Ready", "the 4-GPU pod runs", op, timeout=90)
        assert api.serving("serving")[0].spec.priority == 0
        preempted = [e for e in api.events_for_kind("Pod") if e["reason"] == "Preempted"]
        assert len({e["involvedObject"]["name"] for e in preempted}) == 4, preempted
        assert "WarmPodsYielded" not in _events(api, "serving")
        assert len([p for p in api.warm() if p.spec.node_name]) == 4


def test_ready_never_while_new_pods_could_not_restore(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 3: the manifest deleted under a Ready deployment: not Ready any more, and new pods
    wait for the new SAVE instead of pointing at the missing manifest or capturing natively."""
    with _env(k8s, minio, tmp_path, "adv-ready") as (api, op, prefix):
        spec = md_spec(minio, prefix, replicas=1, save={"podAnnotations": {
            "pod-complete.stage.kwok.x-k8s.io/delay": "600s"}})  # the new SAVE keeps running
        write_test_archive(minio, prefix, spec)
        api.create_md("gone", spec)
        wait_for(lambda: phase(api, "gone") == "Ready", "Ready", op)
        minio.client().delete_object(Bucket=minio.bucket,
                                     Key=f"{prefix}/archives/{identity_of(spec).hash()}/manifest")
        wait_for(lambda: api.condition("gone", "ArchiveReady").get("status") == "False", "ArchiveReady=False",
                 op, timeout=30)
        api.patch_md("gone", {"spec": {"replicas": 2}})
        for _ in range(8):  # several passes (resync 5 s)
            assert phase(api, "gone") != "Ready"
            assert len(api.serving("gone")) == 1, "a new pod started without its archive"
            time.sleep(1)


def test_specs_the_operator_refuses_get_a_status(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 3/6: a trusted key of a key's form that is no ed25519 key (admission cannot tell),
    and a spec with no store while the operator has no default: phase Invalid with the reason,
    one Warning event; nothing is created."""
    with _env(k8s, minio, tmp_path, "adv-invalid", default_store="") as (api, op, prefix):
        not_a_key = [{"id": "k", "publicKey": "A" * 60}]  # base64 of 45 bytes: no DER key
        bad_key = md_spec(minio, prefix, archive={"signing": {"trustedKeys": not_a_key}})
        api.create_md("badkey", bad_key)
        no_store = md_spec(minio, prefix)
        del no_store["store"]
        api.create_md("nostore", no_store)
        for name, reason in (("badkey", "InvalidSpec"), ("nostore", "StoreNotConfigured")):
            wait_for(lambda n=name: phase(api, n) == "Invalid", f"{name}: phase Invalid", op)
            cond = api.condition(name, "Progressing")
            assert cond["status"] == "False" and cond["reason"] == reason, cond
            assert api.md(name)["status"]["observedGeneration"] == 1
            wait_for(lambda n=name, r=reason: r in _events(api, n), f"{name}: a {reason} event", op)
        assert "trustedKeys" in api.condition("badkey", "Progressing")["message"]
        assert not api.archives() and not api.pods("ember.dev/deployment")


def test_tenants_cannot_borrow_the_operators_credentials_or_network_position(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 4: with MinIO the only allowed endpoint, a spec naming the operator's own metrics
    port (an internal endpoint) is refused before any request (no GraphArchive, no SAVE Job); a
    store without credentialsSecret is not read with the operator's credentials
    even though its archive is there."""
    with _env(k8s, minio, tmp_path, "adv-tenant", store_endpoints=minio.endpoint) as (api, op, prefix):
        inside = md_spec(minio, prefix)
        inside["store"]["s3"]["endpoint"] = f"http://127.0.0.1:{op.metrics_port}"
        api.create_md("inside", inside)
        borrowed = md_spec(minio, prefix)
        del borrowed["store"]["s3"]["credentialsSecret"]
        write_test_archive(minio, prefix, borrowed)
        api.create_md("borrowed", borrowed)
        refused = (("inside", "StoreEndpointNotAllowed"), ("borrowed", "OperatorCredentialsNotAllowed"))
        for name, reason in refused:
            wait_for(lambda n=name: phase(api, n) == "Invalid", f"{name}: phase Invalid", op)
            assert _reasons(api, name)["Progressing"] == reason
        assert "store_endpoints" in api.condition("inside", "Progressing")["message"]
        assert not api.archives(), "no GraphArchive, so no probe and no SAVE Job"

        log = op.log_path.read_text(errors="replace")
        assert "ManifestInvalid" not in log  # it never fetched its own metrics page


def test_sizes_are_capped_with_warnings_and_pods_come_in_batches(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 5: replicas and warm GPUs above the operator's caps run at the caps (Warnings); a pod
    wider than max_gpus_per_pod is refused; scaling down goes in batches of pod_batch with
    status written between them; SIGTERM stops the operator promptly mid-scale."""
    settings = {"max_replicas": "30", "max_warm_gpus": "3", "max_gpus_per_pod": "8", "pod_batch": "10"}
    with _env(k8s, minio, tmp_path, "adv-limits", **settings) as (api, op, prefix):
        spec = md_spec(minio, prefix, replicas=10000, warmPool={"size": 50})
        write_test_archive(minio, prefix, spec)
        api.create_md("big", spec)
        wait_for(lambda: len(api.serving("big")) == 30 and phase(api, "big") == "Ready", "30 replicas", op,
                 timeout=120)
        wait_for(lambda: len(api.warm()) == 3, "3 warm pods", op)
        events = _events(api, "big")
        assert "ReplicasCapped" in events and "WarmPoolCapped" in events, events
        assert api.md("big")["status"]["replicas"] == 30
        wide = md_spec(minio, prefix, parallelism={"tensor": 16})
        api.create_md("wide", wide)
        wait_for(lambda: phase(api, "wide") == "Invalid", "16 GPUs per pod refused", op)
        assert _reasons(api, "wide")["Progressing"] == "GpusPerPodAboveLimit"

        seen: set[int] = set()
        api.patch_md("big", {"spec": {"replicas": 1}})

        def scaled() -> bool:
            seen.add(api.md("big")["status"]["replicas"])
            return len(api.serving("big")) == 1

        wait_for(scaled, "scaled to 1", op, timeout=60, interval=0.05)
        assert any(1 < r < 30 for r in seen), f"status between batches: {sorted(seen)}"  # 30 → 20 → 10 → 1
        api.patch_md("big", {"spec": {"replicas": 30}})
        time.sleep(0.3)
        stopping = time.monotonic()
        _stop(op)
        assert time.monotonic() - stopping < 10


def test_sigterm_mid_batch_of_many_pods_stops_within_the_grace_period(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 5: SIGTERM while a pass creates a full batch (the default 500 pods: 4 claimed, the
    rest cold): the pass stops with its in-flight requests (no new ones), so the operator exits
    within seconds — well inside the chart's 30 s termination grace period — instead of finishing
    the batch first; the pass's claims are counted all the same (item 6: warmClaims)."""
    with _env(k8s, minio, tmp_path, "adv-term") as (api, op, prefix):
        play_ready_engines(api)
        spec = md_spec(minio, prefix, replicas=0, warmPool={"size": 4})
        write_test_archive(minio, prefix, spec)
        api.create_md("many", spec)
        wait_for(lambda: len(api.claimable()) == 4, "4 warm pods with a ready engine", op)
        api.patch_md("many", {"spec": {"replicas": 600}})
        wait_for(lambda: len(api.serving("many")) >= 40, "the first pass creating pods", op, interval=0.1)
        stopping = time.monotonic()
        _stop(op)
        took = time.monotonic() - stopping
        created = len(api.serving("many"))
        print(f"SIGTERM with {created} of the batch's 500 pods created: stopped in {took:.1f} s")
        assert took < 10 and created < 500, (took, created)
        assert api.md("many")["status"]["warmClaims"] == 4


def test_the_namespace_warm_cap_trims_the_younger_pools_with_a_warning(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 5: max_namespace_warm_gpus 3 over two deployments of different pools: the older keeps
    its 2 warm GPUs, the younger gets the 1 left (WarmPoolCapped naming the setting); when the
    older grows to 3, the younger's pool is drained and it is told so, with no edit of its own."""
    with _env(k8s, minio, tmp_path, "adv-nswarm", max_namespace_warm_gpus="3") as (api, op, prefix):
        older = md_spec(minio, prefix, replicas=0, warmPool={"size": 2})
        write_test_archive(minio, prefix, older)  # no SAVE here: warm pools need an Available archive
        api.create_md("older", older)
        wait_for(lambda: len(api.warm()) == 2, "the older deployment's 2 warm pods", op)
        younger = md_spec(minio, prefix, replicas=0, warmPool={"size": 2})
        younger["engine"]["image"] = "registry.invalid/ember/engine:other"  # another pool
        write_test_archive(minio, prefix, younger)
        api.create_md("younger", younger)
        wait_for(lambda: "max_namespace_warm_gpus" in _events(api, "younger").get("WarmPoolCapped", ""),
                 "a WarmPoolCapped Warning on the younger deployment", op)
        wait_for(lambda: len(api.warm()) == 3, "2 + 1 warm pods", op)
        time.sleep(2)  # a few passes: the cap holds
        assert len(api.warm()) == 3
        api.patch_md("older", {"spec": {"warmPool": {"size": 3}}})
        pool = "ember.dev/pool-key"
        keys = lambda: {p.metadata.labels[pool] for p in api.warm()}  # noqa: E731
        wait_for(lambda: len(api.warm()) == 3 and len(keys()) == 1, "only the older pool's 3 warm pods", op)
        notes = lambda: [e.get("message") or e.get("note") or "" for e in api.events_for("younger")]  # noqa: E731
        wait_for(lambda: any("keeping 0 warm GPUs" in n for n in notes()), "the younger told", op)


def test_static_limits_are_refused_at_admission_naming_the_limit(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """Item 5, at admission: the chart's limits policy (the limits written into it) refuses a
    `kubectl apply` over limits.maxReplicas, a /scale over it, and warm GPUs, autoscaling and
    shapes over their limits, each with a message naming the limit; at the limit is accepted."""
    ns = k8s.create_namespace("adv-adm")
    api = Api(k8s, ns)
    sets = (f"workloadNamespaces={{{ns}}}", "limits.maxReplicas=30", "limits.maxWarmGpus=4",
            "limits.maxGpusPerPod=8")
    spec = lambda **over: md_spec(minio, "adm", **over)  # noqa: E731
    try:
        with chart_objects(k8s, f"adm-{uuid.uuid4().hex[:6]}", "limits-admission.yaml", *sets, namespace=ns):
            path = tmp_path / "big.json"
            big = {"apiVersion": "ember.dev/v1alpha1", "kind": "ModelDeployment",
                   "metadata": {"name": "big", "namespace": ns}, "spec": spec(replicas=31)}
            path.write_text(json.dumps(big))
            # The policy needs a moment to reach the apiserver's admission (a dry run stores nothing).
            probe = lambda: api.create_md("big", spec(replicas=31), dry_run=True)  # noqa: E731
            wait_for(lambda: "limits.maxReplicas" in refusal(probe), "the policy in force", timeout=30)
            applied = k8s.kubectl("apply", "-f", str(path), check=False)
            named = "replicas 31 is above the limit of 30 replicas per ModelDeployment (limits.maxReplicas)"
            assert applied.returncode != 0 and named in applied.stderr, applied
            cpu = {"type": "Resource", "name": "cpu", "averageUtilization": 50}
            over = (({"warmPool": {"size": 5}}, "above the limit of 4 warm GPUs per ModelDeployment"),
                    ({"parallelism": {"tensor": 16}}, "a replica of 16 GPUs"),
                    ({"parallelism": {"tensor": 2, "alternatives": [{"tensor": 16}]}}, "alternatives"),
                    ({"autoscaling": {"maxReplicas": 40, "targets": [cpu]}}, "autoscaling.maxReplicas 40"))
            for fields, named in over:
                refused = refusal(lambda f=fields: api.create_md("x", spec(**f), dry_run=True))
                assert named in refused, refused
            api.create_md("ok", spec(replicas=30, warmPool={"size": 4}, parallelism={"tensor": 8}))
            scaled = k8s.kubectl("scale", "-n", ns, "md/ok", "--replicas=31", check=False)
            assert scaled.returncode != 0 and "limits.maxReplicas" in scaled.stderr, scaled.stderr
    finally:
        k8s.delete_namespace(ns)



def _stop(op: OperatorProcess) -> None:
    assert op.proc is not None
    op.proc.terminate()
    try:
        op.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        op.kill()
        raise AssertionError("the operator did not stop within 10 s of SIGTERM") from None
