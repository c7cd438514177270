"""ModelDeployment planning: phases, claims before cold pods, rolling moves, native fallback, HPA."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from operator_helpers import CTX, NOW, md_spec, observed

from ember import contract
from ember_operator import naming
from ember_operator.api import MDPhase, ModelDeploymentStatus
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import Plan, plan_deployment, refused_status, revision_of, template_of

URI = "s3://ember/ember/archives/abc/manifest"
AVAILABLE = ArchiveView(name="ga-x", phase="Available", uri=URI, reason="ManifestFound", digest="d" * 64)
SAVING = ArchiveView(name="ga-x", phase="Saving", reason="SaveRunning")
FAILED = ArchiveView(name="ga-x", phase="Failed", reason="SaveFailed", message="SAVE Job failed: OOM",
                     next_retry_time="2026-11-22T02:01:00Z")


def _revision(spec: Any = None) -> str:
    spec = spec or md_spec()
    return revision_of(spec.identity().hash(), template_of("default", spec, CTX), spec)


def _pod(name: str, revision: str, ready: bool = True, restore: str = "",
         archive: str | None = None, digest: str = "") -> PodView:
    """A serving pod; `archive` "" is a native-capture claim, a URI a restoring one pinned to `digest`."""
    ann = {contract.ANN_RESTORE: restore} if restore else {}
    if archive is not None:
        ann[contract.ANN_ARCHIVE] = archive
        pin = {contract.ANN_MANIFEST_DIGEST: digest}
        ann |= pin if archive else {contract.ANN_NATIVE_REASON: "SaveFailed"}
    return PodView(name=name, labels={contract.LABEL_REVISION: revision, contract.LABEL_DEPLOYMENT: "qwen",
                                      contract.LABEL_POOL: "serving"},
                   annotations=ann, ready=ready, phase="Running", created=name)


def _warm(name: str, ready: bool = True) -> PodView:
    return PodView(name=name, labels={contract.LABEL_POOL: "warm"}, resource_version="7", ready=ready,
                   phase="Running" if ready else "Pending", created=name)


def _cond(plan: Plan, type_: str) -> Any:
    return next(c for c in plan.status.conditions if c.type == type_)


def test_first_reconcile_creates_the_archive_and_waits() -> None:
    plan = plan_deployment(observed(), CTX)
    assert plan.archive_create is not None
    assert plan.archive_create["metadata"]["name"] == naming.archive_name(md_spec().identity().hash())
    assert plan.archive_create["spec"]["identityHash"] == md_spec().identity().hash()
    assert not plan.creates and not plan.claims
    assert plan.status.phase is MDPhase.pending
    assert plan.status.observed_generation == 1
    assert all(c.observed_generation == 1 for c in plan.status.conditions)
    short = md_spec().identity().short()
    assert plan.labels == {contract.LABEL_IDENTITY: short, f"ember.dev/uses-{short}": "true"}
    assert plan.status.selector == "ember.dev/deployment=qwen,ember.dev/pool=serving"


def test_saving_waits_without_pods() -> None:
    plan = plan_deployment(observed(archive=SAVING), CTX)
    assert plan.archive_create is None and not plan.creates
    assert plan.status.phase is MDPhase.saving
    assert _cond(plan, "ArchiveReady").reason == "Saving"


def test_available_archive_creates_restoring_pods() -> None:
    plan = plan_deployment(observed(archive=AVAILABLE), CTX)
    assert len(plan.creates) == 2
    names = [p["metadata"]["name"] for p in plan.creates]
    assert names == [naming.serving_pod_name("qwen", _revision(), i) for i in (0, 1)]
    assert all(p["metadata"]["annotations"][contract.ANN_ARCHIVE] == URI for p in plan.creates)
    assert plan.status.phase is MDPhase.deploying
    assert plan.status.archive is not None and plan.status.archive.uri == URI
    assert _cond(plan, "ArchiveReady").status.value == "True"


def test_warm_pods_are_claimed_before_cold_ones_ready_first() -> None:
    spec = md_spec(replicas=3)
    warm = [_warm("w-a", ready=False), _warm("w-b"), _warm("w-c")]
    plan = plan_deployment(observed(spec, archive=AVAILABLE, warm=warm), CTX)
    assert [name for name, _ in plan.claims] == ["w-b", "w-c", "w-a"]
    assert not plan.creates
    spec5 = md_spec(replicas=5)
    plan5 = plan_deployment(observed(spec5, archive=AVAILABLE, warm=warm), CTX)
    assert len(plan5.claims) == 3 and len(plan5.creates) == 2
    assert plan5.status.warm_claims == 3 and plan5.status.replicas == 5


def test_steady_state_is_a_no_op_and_ready() -> None:
    rev = _revision()
    pods = [_pod("a", rev, restore="restored"), _pod("b", rev, restore="restored")]
    plan = plan_deployment(observed(archive=AVAILABLE, pods=pods), CTX)
    assert not plan.creates and not plan.claims and not plan.deletes
    assert plan.status.phase is MDPhase.ready
    assert plan.status.ready_replicas == 2 and plan.status.restored_replicas == 2
    assert _cond(plan, "Progressing").status.value == "False"
    # Idempotent: planning again from the resulting status changes nothing and emits no events.
    again = plan_deployment(observed(archive=AVAILABLE, pods=pods, status=plan.status), CTX)
    assert again.status == plan.status and again.events == []


def test_scale_down_deletes_not_ready_first() -> None:
    rev = _revision()
    spec = md_spec(replicas=1)
    pods = [_pod("a", rev), _pod("b", rev, ready=False), _pod("c", rev)]
    plan = plan_deployment(observed(spec, archive=AVAILABLE, pods=pods), CTX)
    assert plan.deletes[0] == "b" and len(plan.deletes) == 2


def test_scale_up_is_phase_scaling() -> None:
    rev = _revision()
    spec = md_spec(replicas=4)
    pods = [_pod("a", rev), _pod("b", rev)]
    plan = plan_deployment(observed(spec, archive=AVAILABLE, pods=pods), CTX)
    assert len(plan.creates) == 2
    assert plan.status.phase is MDPhase.scaling


def test_failed_archive_serves_natively_and_says_so() -> None:
    plan = plan_deployment(observed(archive=FAILED), CTX)
    assert len(plan.creates) == 2
    assert all(p["metadata"]["annotations"][contract.ANN_ARCHIVE] == "" for p in plan.creates)
    assert all(p["metadata"]["annotations"][contract.ANN_NATIVE_REASON] == "SaveFailed" for p in plan.creates)
    cond = _cond(plan, "ArchiveReady")
    assert cond.status.value == "False" and cond.reason == "SaveFailed"
    assert "native capture" in cond.message and "retrying at" in cond.message
    assert any(e.type == "Warning" and e.reason == "SaveFailed" for e in plan.events)
    rev = _revision()
    native = [_pod("a", rev, archive=""), _pod("b", rev, archive="")]
    serving = plan_deployment(observed(archive=FAILED, pods=native), CTX)
    assert serving.status.phase is MDPhase.degraded
    assert serving.status.native_replicas == 2 and _cond(serving, "Available").reason == "NativeCapture"


def test_missing_secret_and_unreachable_store_serve_natively() -> None:
    for reason in ("CredentialsSecretMissing", "StoreUnreachable"):
        archive = ArchiveView(name="ga-x", phase="Pending", reason=reason, message="boom")
        plan = plan_deployment(observed(archive=archive), CTX)
        assert len(plan.creates) == 2, reason
        assert _cond(plan, "ArchiveReady").reason == reason


def test_retry_of_a_failed_save_does_not_stop_native_serving() -> None:
    rev = _revision()
    spec = md_spec(replicas=3)
    native = [_pod("a", rev, archive=""), _pod("b", rev, archive="")]
    plan = plan_deployment(observed(spec, archive=SAVING, pods=native), CTX)
    assert len(plan.creates) == 1 and not plan.deletes


def test_new_pods_wait_while_a_deleted_manifest_is_saved_again() -> None:
    """Pods restored an archive whose manifest was since deleted (SAVE runs again): new pods wait
    for it instead of capturing natively, and the phase is not Ready."""
    rev = _revision()
    restored = [_pod(n, rev, restore="restored", archive="s3://b/p/archives/x/manifest.json", digest="d")
                for n in ("a", "b")]
    plan = plan_deployment(observed(md_spec(replicas=3), archive=SAVING, pods=restored), CTX)
    assert not plan.creates and not plan.claims and not plan.deletes
    assert plan.status.phase is MDPhase.saving
    settled = plan_deployment(observed(md_spec(replicas=2), archive=SAVING, pods=restored), CTX)
    assert settled.status.phase is not MDPhase.ready


def test_parallelism_edit_reconfigures_then_rolls() -> None:
    old_rev = _revision()
    new_spec = md_spec(parallelism={"data": 2}, gpu={"product": "NVIDIA-H100-80GB-HBM3", "count": 2})
    new_rev = _revision(new_spec)
    assert new_rev != old_rev
    old_pods = [_pod("a", old_rev), _pod("b", old_rev)]
    # New identity → new archive; old pods keep serving meanwhile.
    first = plan_deployment(observed(new_spec, pods=old_pods, generation=2), CTX)
    assert first.archive_create is not None and not first.deletes
    saving = plan_deployment(observed(new_spec, archive=SAVING, pods=old_pods, generation=2), CTX)
    assert saving.status.phase is MDPhase.reconfiguring and not saving.creates and not saving.deletes
    assert "SAVE running" in _cond(saving, "Progressing").message
    # Archive ready: new pods created, old kept until new ones are ready.
    rolling = plan_deployment(observed(new_spec, archive=AVAILABLE, pods=old_pods, generation=2), CTX)
    assert len(rolling.creates) == 2 and not rolling.deletes
    assert rolling.status.phase is MDPhase.reconfiguring
    assert rolling.creates[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    half = [*old_pods, _pod("c", new_rev), _pod("d", new_rev, ready=False)]
    step = plan_deployment(observed(new_spec, archive=AVAILABLE, pods=half, generation=2), CTX)
    assert len(step.drains) == 1 and not step.deletes  # out of service first, deleted after drainSeconds
    done = [*old_pods, _pod("c", new_rev), _pod("d", new_rev)]
    final = plan_deployment(observed(new_spec, archive=AVAILABLE, pods=done, generation=2), CTX)
    assert sorted(final.drains) == ["a", "b"] and final.requeue_after == new_spec.drain_seconds + 0.05


def test_fallback_pods_are_counted_and_degrade() -> None:
    rev = _revision()
    pods = [_pod("a", rev, restore="restored"), _pod("b", rev, restore="fallback: compat mismatch")]
    plan = plan_deployment(observed(archive=AVAILABLE, pods=pods), CTX)
    assert plan.status.fallback_count == 1 and plan.status.restored_replicas == 1
    assert plan.status.phase is MDPhase.degraded
    assert _cond(plan, "Available").reason == "PartialFallback"


def test_dead_pods_are_replaced() -> None:
    rev = _revision()
    pods = [_pod("a", rev), replace(_pod("b", rev, ready=False), phase="Failed")]
    plan = plan_deployment(observed(archive=AVAILABLE, pods=pods), CTX)
    assert plan.deletes == ["b"] and len(plan.creates) == 1


def test_autoscaling_creates_and_removes_the_hpa() -> None:
    spec = md_spec(autoscaling={"minReplicas": 1, "maxReplicas": 4})
    plan = plan_deployment(observed(spec, archive=AVAILABLE), CTX)
    assert plan.hpa_apply is not None and plan.hpa_apply["spec"]["maxReplicas"] == 4
    same = plan_deployment(observed(spec, archive=AVAILABLE, hpa=plan.hpa_apply), CTX)
    assert same.hpa_apply is None
    gone = plan_deployment(observed(archive=AVAILABLE, hpa=plan.hpa_apply), CTX)
    assert gone.hpa_delete


def test_conditions_keep_transition_time_and_emit_events_on_change() -> None:
    p1 = plan_deployment(observed(archive=SAVING), CTX)
    p2 = plan_deployment(observed(archive=SAVING, status=p1.status, now=NOW.replace(minute=5)), CTX)
    t1 = {c.type: c.last_transition_time for c in p1.status.conditions}
    t2 = {c.type: c.last_transition_time for c in p2.status.conditions}
    assert t1 == t2 and p2.events == []
    p3 = plan_deployment(observed(archive=AVAILABLE, status=p2.status, now=NOW.replace(minute=6)), CTX)
    reasons = {e.reason for e in p3.events}
    assert {"ArchiveAvailable", "Deploying"} <= reasons
    rev = _revision()
    pods = [_pod("a", rev), _pod("b", rev)]
    p4 = plan_deployment(observed(archive=AVAILABLE, status=p3.status, pods=pods), CTX)
    assert any(e.reason == "Phase" and "Ready" in e.message for e in p4.events)


def test_scale_to_zero() -> None:
    rev = _revision()
    plan = plan_deployment(observed(md_spec(replicas=0), archive=AVAILABLE, pods=[_pod("a", rev)]), CTX)
    assert plan.deletes == ["a"] and plan.status.replicas == 0
    assert _cond(plan, "Available").reason == "ScaledToZero"


def test_claiming_ready_warm_pods_counts_them_ready() -> None:
    spec = md_spec(replicas=2)
    rev = _revision(spec)
    plan = plan_deployment(observed(spec, archive=AVAILABLE, warm=[_warm("w-a"), _warm("w-b")],
                                    pods=[]), CTX)
    assert len(plan.claims) == 2 and plan.status.ready_replicas == 2
    assert plan.status.phase is MDPhase.ready
    assert rev == plan.status.revision


def test_native_pods_are_replaced_by_restoring_pods_once_the_archive_is_available() -> None:
    """Pods started natively while the archive failed (S3 outage) do not stay native for ever."""
    rev = _revision()
    available = replace(AVAILABLE, digest="d" * 64)
    native = [_pod("a", rev, archive=""), _pod("b", rev, archive="")]
    plan = plan_deployment(observed(archive=available, pods=native), CTX)
    assert len(plan.creates) == 2 and not plan.deletes  # old ones serve until the new are ready
    for pod in plan.creates:
        assert pod["metadata"]["annotations"][contract.ANN_ARCHIVE] == URI
        assert pod["metadata"]["annotations"][contract.ANN_MANIFEST_DIGEST] == "d" * 64
    assert plan.status.phase is MDPhase.reconfiguring
    assert _cond(plan, "Available").reason == "NativeCapture"  # the pods say so, not the archive
    restoring = [_pod(f"r{i}", rev, archive=URI, digest="d" * 64) for i in range(2)]
    done = plan_deployment(observed(archive=available, pods=native + restoring), CTX)
    assert sorted(done.drains) == ["a", "b"] and not done.creates
    final = plan_deployment(observed(archive=available, pods=restoring), CTX)
    assert final.status.phase is MDPhase.ready and final.status.native_replicas == 0


def test_pods_pinned_to_a_replaced_manifest_are_rolled() -> None:
    rev = _revision()
    old = [_pod("a", rev, archive=URI, digest="a" * 64), _pod("b", rev, archive=URI, digest="a" * 64)]
    plan = plan_deployment(observed(archive=replace(AVAILABLE, digest="b" * 64), pods=old), CTX)
    assert len(plan.creates) == 2
    assert all(p["metadata"]["annotations"][contract.ANN_MANIFEST_DIGEST] == "b" * 64 for p in plan.creates)


def test_store_blip_during_save_does_not_start_native_pods() -> None:
    blip = ArchiveView(name="ga-x", phase="Saving", reason="StoreUnreachable", message="timeout")
    assert not blip.failing
    plan = plan_deployment(observed(archive=blip), CTX)
    assert not plan.creates and plan.status.phase is MDPhase.saving


def test_a_save_that_cannot_run_is_said_so() -> None:
    stuck = ArchiveView(name="ga-x", phase="Saving", reason="SaveUnschedulable",
                        message="SAVE Job j (attempt 0) cannot run: Unschedulable: 0/3 nodes are available")
    plan = plan_deployment(observed(archive=stuck), CTX)
    cond = _cond(plan, "ArchiveReady")
    assert cond.reason == "SaveUnschedulable" and "cannot run: Unschedulable" in cond.message
    assert "running" not in cond.message.replace("cannot run", "")


def test_objects_refused_by_the_apiserver_are_in_the_status() -> None:
    from ember_operator.planning import record_refusals

    obs = observed(archive=AVAILABLE)
    plan = plan_deployment(obs, CTX)
    assert len(plan.creates) == 2 and plan.status.replicas == 2
    record_refusals(obs, plan, ["pod qwen-x-0 refused by the API server (403): exceeded quota"] * 2, 2)
    cond = _cond(plan, "Progressing")
    assert cond.status.value == "False" and cond.reason == "CreateRejected"
    assert "exceeded quota" in cond.message
    assert plan.status.replicas == 0 and plan.status.phase is MDPhase.degraded
    assert [e.reason for e in plan.events if e.type == "Warning"].count("CreateRejected") == 1


def test_ready_condition_follows_the_phase_with_observed_generation_everywhere() -> None:
    rev = _revision()
    pods = [_pod("a", rev, restore="restored"), _pod("b", rev, restore="restored")]
    ready = plan_deployment(observed(archive=AVAILABLE, pods=pods, generation=3), CTX)
    assert ready.status.conditions[0].type == "Ready"
    assert _cond(ready, "Ready").status.value == "True" and _cond(ready, "Ready").reason == "Ready"
    assert {c.observed_generation for c in ready.status.conditions} == {3}
    assert ready.status.observed_generation == 3
    assert not [e for e in ready.events if e.reason == "Ready"]  # the Phase event says it
    saving = plan_deployment(observed(archive=SAVING, generation=4), CTX)
    cond = _cond(saving, "Ready")
    assert (cond.status.value, cond.reason) == ("False", "Saving") and "SAVE" in cond.message
    one_down = plan_deployment(observed(archive=AVAILABLE, pods=[pods[0], _pod("b", rev, ready=False)]), CTX)
    assert (_cond(one_down, "Ready").status.value, _cond(one_down, "Ready").reason) == ("False", "Scaling")


def test_a_refused_spec_is_not_ready_and_says_why() -> None:
    st, _ = refused_status(ModelDeploymentStatus(), 5, NOW, "InvalidSpec", "gpu.count: wrong")
    cond = next(c for c in st.conditions if c.type == "Ready")
    assert (cond.status.value, cond.reason, cond.message) == ("False", "Invalid", "gpu.count: wrong")
    assert cond.observed_generation == 5
