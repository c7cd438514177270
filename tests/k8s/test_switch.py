"""Parallelism switches by editing the CR, on the real control plane + kwok + MinIO: archives saved
ahead for `spec.parallelism.alternatives` (one low-priority single-GPU SAVE Job per identity),
new-shape pods from the warm pool, capacity kept, old pods drained then deleted, truthful status
and events; an edit back mid-switch, an edit during a scale-up, an HPA acting during a switch,
and a SIGKILLed leader during a switch all converge with no orphan pods."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from operator_harness import (
    Api,
    OperatorProcess,
    ensure_priority_class,
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

PRESAVE = "ember-presave-test"
DP1 = {"tensor": 1, "expert": 1, "data": 1}
EP2 = {"tensor": 1, "expert": 2, "data": 2}
TP2 = {"tensor": 2, "expert": 1, "data": 1}
SAVE_RUNS = {"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    ensure_priority_class(k8s, PRESAVE)
    settings = {"EMBER_OPERATOR_PRESAVE_PRIORITY_CLASS": PRESAVE}
    with operator_env(k8s, minio, tmp_path, "sw", env=settings) as e:
        yield e


def shaped(spec: dict[str, Any], shape: dict[str, int], alternatives: list[dict[str, int]]) -> dict[str, Any]:
    return {**spec, "parallelism": {**shape, "alternatives": alternatives}}


def write_all(minio: LocalMinio, prefix: str, spec: dict[str, Any]) -> None:
    """The archives of every shape of `spec`, as their SAVE Jobs would write them."""
    for shape in [spec["parallelism"], *spec["parallelism"].get("alternatives", [])]:
        plain = {k: shape[k] for k in ("tensor", "expert", "data")}
        write_test_archive(minio, prefix, shaped(spec, plain, []))


def gpus(pod: Any) -> int:
    return int(pod.spec.containers[0].resources.limits["nvidia.com/gpu"])


def tp_ep_dp(pod: Any) -> tuple[int, int, int]:
    par = json.loads(pod.metadata.annotations["ember.dev/identity-spec"])["parallelism"]
    return par["tensor"], par["expert"], par["data"]


def key(shape: dict[str, int]) -> tuple[int, int, int]:
    return shape["tensor"], shape["expert"], shape["data"]


def settled(api: Api, name: str, shape: dict[str, int], replicas: int) -> bool:
    md = api.md(name)
    st = md.get("status") or {}
    pods = api.serving(name)
    return (st.get("phase") == "Ready" and not st.get("switch") and st.get("observedGeneration") ==
            md["metadata"]["generation"] and len(pods) == replicas
            and all(tp_ep_dp(p) == key(shape) and gpus(p) == shape["tensor"] * shape["data"] for p in pods)
            and not api.pods(f"ember.dev/deployment={name},ember.dev/pool=draining"))


def no_orphans(api: Api, name: str, replicas: int) -> None:
    """Every pod of the namespace is a serving pod of the deployment, a warm pod, or a SAVE pod."""
    pods = [p for p in api.core.list_namespaced_pod(api.ns).items if p.metadata.deletion_timestamp is None]
    serving = [p for p in pods if (p.metadata.labels or {}).get("ember.dev/pool") == "serving"]
    assert len(serving) == replicas and len({p.metadata.name for p in serving}) == replicas
    assert all(p.metadata.owner_references and p.metadata.owner_references[0].name == name for p in serving)
    other = [p.metadata.name for p in pods if (p.metadata.labels or {}).get("ember.dev/pool") not in
             ("serving", "warm") and "ember.dev/archive" not in (p.metadata.labels or {})]
    assert other == [], f"orphans: {other}"


class Capacity:
    """Samples the ready serving pods of a deployment in the background (their minimum is the
    capacity the switch kept) and every pool label a pod of it carried."""

    def __init__(self, api: Api, name: str) -> None:
        self.api, self.name = api, name
        self.min_ready = 10**9
        self.pools: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            selector = f"ember.dev/deployment={self.name}"
            pods = self.api.core.list_namespaced_pod(self.api.ns, label_selector=selector)
            ready = [p for p in pods.items if (p.metadata.labels or {}).get("ember.dev/pool") == "serving"
                     and any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))]
            self.min_ready = min(self.min_ready, len(ready))
            self.pools |= {(p.metadata.labels or {}).get("ember.dev/pool", "") for p in pods.items}
            time.sleep(0.1)

    def __enter__(self) -> Capacity:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(5)


def reasons(api: Api, name: str) -> list[str]:
    return [e.get("reason") for e in api.events_for(name)]


def test_alternatives_are_presaved_once_each_at_low_priority(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = shaped(md_spec(minio, prefix, replicas=1, save=SAVE_RUNS), DP1, [EP2, TP2, DP1])
    api.create_md("moe", spec)
    jobs = wait_for(lambda: len(j := api.jobs()) == 3 and j, "one SAVE Job per shape", op)
    by_identity = {j.metadata.labels["ember.dev/identity"]: j for j in jobs}
    current = identity_of(spec).short()
    assert set(by_identity) == {identity_of(shaped(spec, s, [])).short() for s in (DP1, EP2, TP2)}
    for short, job in by_identity.items():
        pod = job.spec.template.spec
        assert pod.containers[0].resources.limits["nvidia.com/gpu"] == "1", "SAVE of any shape: one GPU"
        assert pod.priority_class_name == (None if short == current else PRESAVE)
    md = api.md("moe")
    assert [(s["gpus"], s["current"]) for s in md["status"]["shapes"]] == [(1, True), (2, False), (2, False)]
    assert all(md["metadata"]["labels"].get(f"ember.dev/uses-{s}") == "true" for s in by_identity)
    write_test_archive(minio, prefix, spec)
    wait_for(lambda: phase(api, "moe") == "Ready", "Ready on the current shape's archive", op)
    write_all(minio, prefix, spec)
    wait_for(lambda: all(s["phase"] == "Available" for s in api.md("moe")["status"]["shapes"]),
             "every alternative's archive Available", op)
    time.sleep(3)
    assert len(api.jobs()) == 3 and len(api.archives()) == 3, "one SAVE Job and one archive per identity"
    # Dropping an alternative drops its label (its archive loses that user).
    api.patch_md("moe", {"spec": {"parallelism": {"alternatives": [EP2]}}})
    tp2 = identity_of(shaped(spec, TP2, [])).short()
    wait_for(lambda: f"ember.dev/uses-{tp2}" not in api.md("moe")["metadata"]["labels"], "label dropped", op)


def test_switch_takes_warm_pods_keeps_capacity_and_drains(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    play_ready_engines(api)
    # Both shapes listed: whichever is current, the other keeps its warm pods and its archive.
    spec = shaped(md_spec(minio, prefix, replicas=2, warmPool={"size": 4}, drainSeconds=3), DP1, [DP1, EP2])
    write_all(minio, prefix, spec)
    api.create_md("moe", spec)
    wait_for(lambda: settled(api, "moe", DP1, 2), "Ready on DP1", op)
    warm = wait_for(lambda: (w := api.claimable()) and sorted(gpus(p) for p in w) == [1, 1, 2] and w,
                    "warm pods with a ready engine: 4 GPUs as 2×1 + 1×2", op)
    warm_two = {p.metadata.name for p in warm if gpus(p) == 2}
    old = {p.metadata.name for p in api.serving("moe")}
    with Capacity(api, "moe") as cap:
        started = time.monotonic()
        api.patch_md("moe", {"spec": {"parallelism": EP2}})
        wait_for(lambda: (api.md("moe").get("status") or {}).get("switch"), "status.switch", op)
        st = api.md("moe")["status"]
        assert st["switch"]["previous"] == DP1 and st["switch"]["target"] == EP2 and st["switch"]["presaved"]
        wait_for(lambda: settled(api, "moe", EP2, 2), "every pod on EP2, old ones gone", op, timeout=60)
        took = time.monotonic() - started
    serving = {p.metadata.name for p in api.serving("moe")}
    assert warm_two <= serving, "the warm 2-GPU pod was claimed for the new shape"
    assert not old & serving
    assert cap.min_ready >= 2, f"capacity dropped to {cap.min_ready} ready pods during the switch"
    assert "draining" in cap.pools, "old pods left service through draining"
    assert api.jobs() == [], "every archive was there before: no SAVE at all"
    steps = ("SwitchStarted", "NewShapeReady", "Draining", "SwitchComplete")  # posted after the status
    wait_for(lambda: set(steps) <= set(reasons(api, "moe")), "an event for each step", op)
    assert phase(api, "moe") == "Ready" and api.condition("moe", "Progressing")["reason"] == "Complete"
    wait_for(lambda: sorted(gpus(p) for p in api.warm()) == [1, 1, 2], "pool topped up per GPU count", op)
    no_orphans(api, "moe", 2)
    print(f"switch DP1 → EP2 (2 replicas): {took:.1f} s to all new pods Ready and old ones deleted")


def test_edit_back_mid_switch_reuses_draining_pods(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = shaped(md_spec(minio, prefix, replicas=2, drainSeconds=30), DP1, [EP2])
    write_all(minio, prefix, spec)
    api.create_md("moe", spec)
    wait_for(lambda: settled(api, "moe", DP1, 2), "Ready on DP1", op)
    original = {p.metadata.name for p in api.serving("moe")}
    api.patch_md("moe", {"spec": {"parallelism": EP2}})
    wait_for(lambda: len(api.pods("ember.dev/deployment=moe,ember.dev/pool=draining")) == 2,
             "both DP1 pods draining", op)
    api.patch_md("moe", {"spec": {"parallelism": DP1}})
    wait_for(lambda: original <= {p.metadata.name for p in api.serving("moe")}, "DP1 pods back in service",
             op)
    # the status follows the pods by one reconcile: wait for it, the EP2 pods drain for 30 s
    def switching_back() -> bool:
        st = api.md("moe").get("status") or {}
        return (st.get("switch") or {}).get("target") == DP1 and st.get("phase") == "Switching"

    wait_for(switching_back, "status: switching back to DP1", op, timeout=20)
    wait_for(lambda: settled(api, "moe", DP1, 2), "settled back on DP1 after the EP2 pods drained", op,
             timeout=60)
    assert {p.metadata.name for p in api.serving("moe")} == original
    no_orphans(api, "moe", 2)


def test_edit_during_scale_up_and_hpa_during_switch_converge(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = shaped(md_spec(minio, prefix, replicas=2, warmPool={"size": 2}, drainSeconds=2), DP1, [EP2])
    write_all(minio, prefix, spec)
    api.create_md("moe", spec)
    wait_for(lambda: settled(api, "moe", DP1, 2), "Ready on DP1", op)
    # A scale-up, and the switch edited while its pods are still coming.
    api.k8s.kubectl("scale", "-n", api.ns, "md/moe", "--replicas=5")
    wait_for(lambda: len(api.serving("moe")) > 2, "scale-up under way", op, interval=0.05)
    api.patch_md("moe", {"spec": {"parallelism": EP2}})
    wait_for(lambda: settled(api, "moe", EP2, 5), "5 EP2 replicas", op, timeout=90)
    no_orphans(api, "moe", 5)
    # An HPA acting during a switch back: minReplicas raises /scale while pods move.
    api.patch_md("moe", {"spec": {"parallelism": DP1}})
    wait_for(lambda: (api.md("moe").get("status") or {}).get("switch"), "switch under way", op)
    api.patch_md("moe", {"spec": {"autoscaling": {"minReplicas": 7, "maxReplicas": 8}}})
    wait_for(lambda: api.md("moe")["spec"]["replicas"] == 7, "HPA scaled to 7", op, timeout=90)
    wait_for(lambda: settled(api, "moe", DP1, 7), "7 DP1 replicas", op, timeout=90)
    no_orphans(api, "moe", 7)


def test_sigkill_of_the_leader_during_a_switch(k8s: LocalCluster, minio: LocalMinio, crds: None,
                                               tmp_path: Path) -> None:
    ha = {"EMBER_OPERATOR_STANDALONE": "false", "EMBER_OPERATOR_LEASE_DURATION_SECONDS": "3",
          "EMBER_OPERATOR_LEASE_RETRY_SECONDS": "0.5", "EMBER_OPERATOR_PRESAVE_PRIORITY_CLASS": PRESAVE}
    ensure_priority_class(k8s, PRESAVE)
    # The admin identity: in the RBAC run (EMBER_TEST_OPERATOR_KUBECONFIG=sa) the chart's Lease Role
    # exists only in its release namespace, not in this test's.
    admin = k8s.kubeconfig
    with operator_env(k8s, minio, tmp_path, "swha", env=ha, kubeconfig=admin) as (api, first, prefix):
        second = OperatorProcess(kubeconfig=first.kubeconfig, namespace=api.ns, log_path=tmp_path / "op2.log",
                                 env=ha).start()
        try:
            base = md_spec(minio, prefix, replicas=6, warmPool={"size": 2}, drainSeconds=2)
            spec = shaped(base, DP1, [EP2])
            write_all(minio, prefix, spec)
            api.create_md("moe", spec)
            wait_for(lambda: settled(api, "moe", DP1, 6), "Ready on DP1", first)
            coord = client.CoordinationV1Api(k8s.api_client)
            holder = coord.read_namespaced_lease("ember-operator", api.ns).spec.holder_identity
            api.patch_md("moe", {"spec": {"parallelism": EP2}})
            wait_for(lambda: any(tp_ep_dp(p) == key(EP2) for p in api.serving("moe")), "first EP2 pods",
                     first, interval=0.02)
            leader = first if "ModelDeployment" in first.log_path.read_text() else second
            leader.kill()
            wait_for(lambda: settled(api, "moe", EP2, 6), "6 EP2 replicas after the hand-over", second,
                     timeout=90)
            assert coord.read_namespaced_lease("ember-operator", api.ns).spec.holder_identity != holder
            no_orphans(api, "moe", 6)
            assert api.jobs() == [] and len(api.archives()) == 2
        finally:
            second.stop()


DP2 = {"tensor": 1, "expert": 1, "data": 2}
VLLM = {"kind": "vllm", "version": "0.26.0", "image": "registry.invalid/ember/vllm:test"}


def vllm_dp(pod: Any) -> int:
    """vLLM's data-parallel size in the pod's claim (1 when the arguments name none)."""
    args = json.loads(pod.metadata.annotations["ember.dev/engine-args"])
    return int(args[args.index("--data-parallel-size") + 1]) if "--data-parallel-size" in args else 1


def test_vllm_dense_data_parallel_shapes_share_one_archive_and_switch_without_a_save(
    env: Any, minio: LocalMinio,
) -> None:
    """vLLM runs a dense model's DP replicas as engines of their own: DP1 and DP2 are one identity,
    one GraphArchive; a switch between them moves to 2-GPU pods of the same archive, vLLM told its
    DP size by the claim, and the status names the shape it leaves."""
    api, op, prefix = env
    spec = shaped(md_spec(minio, prefix, replicas=1, engine=VLLM, drainSeconds=1), DP1, [DP1, DP2])
    write_test_archive(minio, prefix, spec)
    api.create_md("dense", spec)

    def on(dp: int) -> bool:
        st, pods = api.md("dense").get("status") or {}, api.serving("dense")
        return (st.get("phase") == "Ready" and not st.get("switch") and len(pods) == 1
                and all(gpus(p) == dp and vllm_dp(p) == dp and tp_ep_dp(p) == key(DP1) for p in pods))

    wait_for(lambda: on(1), "Ready on DP1", op)
    assert [(s["data"], s["phase"]) for s in api.md("dense")["status"]["shapes"]] == [(1, "Available"),
                                                                                    (2, "Available")]
    api.patch_md("dense", {"spec": {"parallelism": DP2}})
    wait_for(lambda: (api.md("dense").get("status") or {}).get("switch"), "status.switch", op)
    sw = api.md("dense")["status"]["switch"]
    assert sw["previous"] == DP1 and sw["target"] == DP2 and sw["presaved"]
    wait_for(lambda: on(2), "one 2-GPU pod of the same archive, the DP1 pod gone", op, timeout=60)
    assert api.jobs() == [] and len(api.archives()) == 1, "one identity: no SAVE, one archive"
    no_orphans(api, "dense", 1)
