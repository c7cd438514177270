"""Status that never says Ready when pods cannot run, refused specs, and which stores a namespace
may make the operator use (pure planning; the same cases on the local cluster: tests/k8s/
test_adversarial.py)."""

from __future__ import annotations

import pytest
from operator_helpers import CTX, NOW, md_spec, observed
from pydantic import ValidationError

from ember import contract
from ember_operator.api import MDPhase, ModelDeploymentSpec, ModelDeploymentStatus, StoreSpec
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import plan_deployment, refused_status, revision_of, template_of
from ember_operator.tenancy import (
    CREDENTIALS_NOT_ALLOWED,
    ENDPOINT_NOT_ALLOWED,
    Tenancy,
    endpoint_allowed,
    store_refusal,
)

AVAILABLE = ArchiveView(name="ga-x", phase="Available", uri="s3://ember/archives/x/manifest.json", digest="d")


def _unschedulable(name: str, revision: str, message: str) -> PodView:
    return PodView(name=name, labels={contract.LABEL_REVISION: revision, contract.LABEL_POOL: "serving"},
                   unschedulable=message)


def test_pending_pods_make_schedulable_false_with_the_schedulers_message() -> None:
    spec = md_spec(replicas=1)
    rev = revision_of(spec.identity().hash(), template_of("default", spec, CTX), spec)
    msg = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    plan = plan_deployment(observed(spec, archive=AVAILABLE, pods=[_unschedulable("qwen-a", rev, msg)]), CTX)
    assert plan.unschedulable is not None
    reason, text = plan.unschedulable
    assert reason == "PodsUnschedulable" and "qwen-a" in text and msg in text
    progressing = next(c for c in plan.status.conditions if c.type == "Progressing")
    assert "stuck: 1 new pod(s) cannot be scheduled (qwen-a" in progressing.message


def test_pending_warm_pods_are_named_too() -> None:
    warm = PodView(name="ember-warm-k-0", labels={contract.LABEL_POOL: "warm"}, unschedulable="no GPUs")
    plan = plan_deployment(observed(md_spec(), archive=AVAILABLE, warm_pending=[warm]), CTX)
    assert plan.unschedulable == ("WarmPodsUnschedulable", "1 warm pod(s) cannot be scheduled: "
                                  "ember-warm-k-0: no GPUs")


def test_never_ready_while_the_archive_is_not_ready_or_pods_cannot_be_scheduled() -> None:
    from ember_operator import conditions
    from ember_operator.planning import derive_phase

    def conds(archive: bool, schedulable: bool | None = None) -> list:  # type: ignore[type-arg]
        out = conditions.put([], "ArchiveReady", archive, "x", "", 1, NOW)
        out = conditions.put(out, "Available", True, "ReplicasReady", "", 1, NOW)
        out = conditions.put(out, "Progressing", False, "Complete", "", 1, NOW)
        if schedulable is not None:
            out = conditions.put(out, "Schedulable", schedulable, "x", "", 1, NOW)
        return out

    assert derive_phase(conds(True, True)) is MDPhase.ready
    assert derive_phase(conds(False)) is MDPhase.degraded
    assert derive_phase(conds(True, False)) is MDPhase.degraded


def test_refused_spec_gets_phase_invalid_and_one_event() -> None:
    st, events = refused_status(ModelDeploymentStatus(), 3, NOW, "InvalidSpec", "model.dtype: bad")
    assert st.phase is MDPhase.invalid and st.observed_generation == 3
    assert [e.type for e in events] == ["Warning"]
    again, events = refused_status(st, 3, NOW, "InvalidSpec", "model.dtype: bad")
    assert again.phase is MDPhase.invalid and not events


def test_a_trusted_key_that_is_not_a_key_is_refused_by_the_model() -> None:
    with pytest.raises(ValidationError, match="trustedKeys"):
        md_spec(archive={"signing": {"trustedKeys": [{"id": "k", "publicKey": "A" * 60}]}})


@pytest.mark.parametrize(("endpoint", "allowed", "ok"), [
    ("http://10.0.0.5:9000", ("http://10.0.0.5:9000",), True),
    ("http://10.0.0.5:9001", ("http://10.0.0.5:9000",), False),
    ("http://10.0.0.5:9001", ("http://10.0.0.5",), True),
    ("https://10.0.0.5:9000", ("http://10.0.0.5",), False),
    ("http://169.254.169.254", ("http://10.0.0.5",), False),
    ("http://anything:1", ("*",), True),
])
def test_endpoint_allow_list(endpoint: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert endpoint_allowed(endpoint, allowed) is ok


def test_store_refusals() -> None:
    tenancy = Tenancy(default_store="s3://shared/ember", default_s3_endpoint="http://minio:9000",
                      credential_namespaces=("trusted",))
    own = StoreSpec.model_validate({"s3": {"bucket": "tenant", "endpoint": "http://minio:9000",
                                           "credentialsSecret": "s3"}})
    assert store_refusal(own, "t1", tenancy) is None
    elsewhere = own.model_copy(update={"s3": own.s3.model_copy(update={"endpoint": "http://127.0.0.1:2379"})})
    assert store_refusal(elsewhere, "t1", tenancy)[0] == ENDPOINT_NOT_ALLOWED  # type: ignore[index]
    borrowed = StoreSpec.model_validate({"s3": {"bucket": "tenant", "endpoint": "http://minio:9000"}})
    assert store_refusal(borrowed, "t1", tenancy)[0] == CREDENTIALS_NOT_ALLOWED  # type: ignore[index]
    assert store_refusal(borrowed, "trusted", tenancy) is None
    assert store_refusal(tenancy.default(), "t1", tenancy) is None  # the admin's own store


def test_identity_strings_are_refused_by_the_model_too() -> None:
    bad = ({"name": "a\nb"}, {"name": "x", "revision": "../../etc"}, {"name": "x", "dtype": "float1024"})
    for model in bad:
        with pytest.raises(ValidationError):
            ModelDeploymentSpec.model_validate({**md_spec().model_dump(by_alias=True), "model": model})


def test_limits_cap_replicas_and_warm_gpus_and_refuse_wide_pods() -> None:
    from ember_operator.limits import Left, Limits, apply_limits
    from ember_operator.tenancy import Refused

    spec = md_spec(replicas=10000, warmPool={"size": 50})
    capped, events = apply_limits(spec, Limits(max_replicas=1000, max_warm_gpus=8), Left(replicas=300))
    assert capped.replicas == 300 and capped.warm_pool.size == 8
    assert [e.reason for e in events] == ["ReplicasCapped", "ReplicasCapped", "WarmPoolCapped"]
    # What the namespace's warm cap leaves: the pool is trimmed further, with a Warning naming it.
    capped, events = apply_limits(spec, Limits(max_warm_gpus=8), Left(warm_gpus=5))
    assert capped.warm_pool.size == 5 and "max_namespace_warm_gpus" in events[-1].message
    assert apply_limits(md_spec(replicas=3), Limits(max_replicas=1000)) == (md_spec(replicas=3), [])
    wide = md_spec(parallelism={"tensor": 8}, gpu={"product": "NVIDIA-H100-80GB-HBM3"})
    with pytest.raises(Refused, match="8 GPUs is above the operator's limit of 4"):
        apply_limits(wide, Limits(max_gpus_per_pod=4))


def test_a_pass_creates_and_deletes_at_most_a_batch() -> None:
    from dataclasses import replace

    ctx = replace(CTX, pod_batch=100)
    plan = plan_deployment(observed(md_spec(replicas=1000), archive=AVAILABLE), ctx)
    assert len(plan.creates) == 100 and plan.requeue_after is not None and plan.requeue_after < 1
    assert plan.status.replicas == 100


def test_warm_pods_of_one_node_yield_to_a_serving_pod_that_lacks_gpus() -> None:
    from ember_operator.pools import gpu_starved, warm_to_yield

    def warm(name: str, node: str, gpus: int, pool: str = "other") -> PodView:
        return PodView(name=name, labels={contract.LABEL_POOL_KEY: pool}, node=node, gpus=gpus)

    pending = PodView(name="new", gpus=4, unschedulable="0/4 nodes: 4 Insufficient nvidia.com/gpu.")
    assert gpu_starved(pending)
    pods = [warm("a", "n1", 2), warm("b", "n2", 1), warm("c", "n2", 1), warm("d", "n1", 2),
            warm("e", "n3", 4, pool="mine"), warm("f", "", 4)]
    assert sorted(warm_to_yield([pending], pods, "mine")) == ["a", "d"]  # one node covers it
    # No node has 4 warm GPUs: the one with the most gives them (its free GPUs may do the rest).
    assert sorted(warm_to_yield([pending], [*pods[1:3], warm("g", "n4", 1)], "mine")) == ["b", "c"]
    # The scheduler nominated a node: it preempts lower-priority warm pods there itself.
    nominated = PodView(name="new", gpus=4, unschedulable=pending.unschedulable, nominated="n1")
    assert warm_to_yield([nominated], pods, "mine") == []


def test_an_archive_of_a_store_its_namespace_may_not_use_fails_without_a_save_job() -> None:
    from ember_operator.api import GraphArchiveSpec, GraphArchiveStatus, IdentitySpec, SaveSpec
    from ember_operator.archive_planning import ArchiveObserved, Backoff, StoreProbe, plan_archive

    spec = md_spec()
    ga = GraphArchiveSpec(identity_hash=spec.identity().hash(), identity=IdentitySpec.of(spec.identity()),
                          store=spec.store, save=SaveSpec(image="engine:test"))  # type: ignore[arg-type]
    obs = ArchiveObserved(name="ga-x", namespace="t1", uid="u", generation=1, spec=ga,
                          status=GraphArchiveStatus(), now=NOW,
                          probe=StoreProbe(refused=(ENDPOINT_NOT_ALLOWED, "not on the allow-list")))
    plan = plan_archive(obs, Backoff())
    assert plan.status.phase is not None and plan.status.phase.value == "Failed"
    assert plan.create_job_attempt is None
    assert next(c for c in plan.status.conditions if c.type == "Saved").reason == ENDPOINT_NOT_ALLOWED


def test_the_namespace_caps_serve_older_deployments_first() -> None:
    from ember_operator.conditions import Event
    from ember_operator.limits import Left, Limits, Notices, namespace_left

    def md(name: str, created: str, replicas: int, warm: int = 0) -> dict:  # type: ignore[type-arg]
        return {"metadata": {"name": name, "creationTimestamp": created},
                "spec": {"replicas": replicas, "warmPool": {"size": warm}}}

    mds = [md("a", "2026-01-01T00:00:00Z", 40, 20), md("b", "2026-01-02T00:00:00Z", 5, 4),
           md("c", "2026-01-03T00:00:00Z", 9, 9)]
    limits = Limits(max_replicas=30, max_warm_gpus=16, max_namespace_replicas=50, max_namespace_warm_gpus=24)
    assert [namespace_left(mds, m["metadata"], limits) for m in mds] == [
        Left(50, 24), Left(20, 8), Left(15, 4)]
    assert namespace_left(mds, mds[2]["metadata"], Limits(max_namespace_warm_gpus=24)) == Left(None, 0)
    assert namespace_left(mds, mds[2]["metadata"], Limits()) == Left()
    # Cap warnings are said once per change, not on every pass.
    notices, ev = Notices(), [Event("Warning", "WarmPoolCapped", "x")]
    assert notices.fresh(("ns", "c"), ev) == ev and notices.fresh(("ns", "c"), ev) == []
    assert notices.fresh(("ns", "c"), []) == [] and notices.fresh(("ns", "c"), ev) == ev

def test_a_status_of_another_operator_version_keeps_what_this_one_reads() -> None:
    """Issue 38 item 6: warmClaims is a lifetime count. A status this version cannot read in full
    (a newer version's phase, a condition of an unknown status) was discarded whole, so the count
    read 0 after a restart onto another version: now only the unreadable fields start afresh."""
    from ember_operator.observed import status_of

    raw = {"phase": "Stalled", "warmClaims": 7, "replicas": 3, "observedGeneration": 4,
           "conditions": [{"type": "Available", "status": "Maybe"}], "futureField": {"x": 1}}
    status = status_of(raw)
    assert status.warm_claims == 7 and status.replicas == 3 and status.observed_generation == 4
    assert status.phase is None and status.conditions == []
    assert status_of({"warmClaims": "many"}).warm_claims == 0
