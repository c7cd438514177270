"""GraphArchive planning: store probe outcomes, one SAVE Job per attempt, backoff, verify, GC."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from operator_helpers import CTX, NOW, md_spec

from ember.contract import SaveResult
from ember_operator import naming
from ember_operator.api import GAPhase, GraphArchiveSpec, GraphArchiveStatus
from ember_operator.archive_planning import (
    ArchiveObserved,
    Backoff,
    ManifestInfo,
    StoreProbe,
    plan_archive,
)
from ember_operator.planning import archive_object

SPEC = GraphArchiveSpec.model_validate(archive_object("ga-x", "default", md_spec(), CTX)["spec"])
HASH = SPEC.identity_hash
BACKOFF = Backoff(base_s=10, max_s=600, grace_s=30, retention_s=3600)


def _obs(
    status: GraphArchiveStatus | None = None, probe: StoreProbe | None = None, **over,
) -> ArchiveObserved:
    fields = dict(name="ga-x", namespace="default", uid="u", generation=1, spec=SPEC,
                  status=status or GraphArchiveStatus(), probe=probe or StoreProbe(), now=NOW)
    fields.update(over)
    return ArchiveObserved(**fields)


def _job(attempt: int, state: str, done=NOW) -> dict:
    conds = {"Active": [], "Succeeded": [{"type": "Complete", "status": "True"}],
             "Failed": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}[state]
    return {naming.save_job_name(HASH, attempt): {"status": {
        "conditions": conds, "completionTime": done.strftime("%Y-%m-%dT%H:%M:%SZ")}}}


def _saved(plan) -> tuple[str, str]:
    c = next(c for c in plan.status.conditions if c.type == "Saved")
    return c.status.value, c.reason


def test_manifest_in_store_means_available_without_a_job() -> None:
    info = ManifestInfo(uri="s3://ember/ember/archives/x/manifest", digest="d" * 64, bytes=10, graphs=4)
    plan = plan_archive(_obs(probe=StoreProbe(manifest=info)), BACKOFF)
    assert plan.status.phase is GAPhase.available and plan.create_job_attempt is None
    assert plan.status.uri == info.uri and plan.status.bytes == 10 and plan.status.graphs == 4
    assert _saved(plan) == ("True", "ManifestFound") and plan.saved_now


def test_first_pass_creates_attempt_zero() -> None:
    plan = plan_archive(_obs(), BACKOFF)
    assert plan.create_job_attempt == 0
    assert plan.status.phase is GAPhase.saving
    assert plan.status.save_job == naming.save_job_name(HASH, 0)
    # Restarted operator with the Job already there: no second Job.
    again = plan_archive(_obs(status=plan.status, jobs=_job(0, "Active")), BACKOFF)
    assert again.create_job_attempt is None and again.status.phase is GAPhase.saving


def test_missing_secret_and_unreachable_store_retry_without_a_job() -> None:
    p1 = plan_archive(_obs(probe=StoreProbe(secret_missing=True)), BACKOFF)
    assert p1.create_job_attempt is None and _saved(p1) == ("False", "CredentialsSecretMissing")
    assert p1.status.next_retry_time and p1.requeue_after == 10
    assert "'s3'" in (p1.status.failure_reason or "")
    p2 = plan_archive(_obs(probe=StoreProbe(unreachable="connect timeout")), BACKOFF)
    assert p2.create_job_attempt is None and _saved(p2) == ("False", "StoreUnreachable")
    assert "connect timeout" in (p2.status.failure_reason or "")


def test_failed_save_backs_off_then_retries_as_a_new_attempt() -> None:
    st = plan_archive(_obs(), BACKOFF).status
    failed = plan_archive(_obs(status=st, jobs=_job(0, "Failed"),
                               result=SaveResult(succeeded=False, message="CUDA out of memory")), BACKOFF)
    assert failed.status.phase is GAPhase.failed and failed.save_failed_now
    assert "CUDA out of memory" in (failed.status.failure_reason or "")
    assert _saved(failed)[1] == "SaveFailed" and failed.create_job_attempt is None
    assert failed.requeue_after == 10
    later = plan_archive(_obs(status=failed.status, jobs=_job(0, "Failed"),
                              now=NOW + timedelta(seconds=11)), BACKOFF)
    assert later.create_job_attempt == 1 and later.status.attempt == 1
    assert later.status.save_job == naming.save_job_name(HASH, 1)
    assert later.status.phase is GAPhase.saving


def test_backoff_doubles_and_caps() -> None:
    assert [BACKOFF.delay(a) for a in range(8)] == [10, 20, 40, 80, 160, 320, 600, 600]


def test_succeeded_job_waits_for_the_manifest_then_fails() -> None:
    st = plan_archive(_obs(), BACKOFF).status
    verifying = plan_archive(_obs(status=st, jobs=_job(0, "Succeeded", done=NOW)), BACKOFF)
    assert verifying.status.phase is GAPhase.saving and _saved(verifying)[1] == "Verifying"
    old = NOW - timedelta(seconds=60)
    missing = plan_archive(_obs(status=st, jobs=_job(0, "Succeeded", done=old)), BACKOFF)
    assert missing.status.phase is GAPhase.failed and _saved(missing)[1] == "ManifestMissing"


def test_unreferenced_archive_is_collected_after_retention() -> None:
    p1 = plan_archive(_obs(references=0), BACKOFF)
    assert not p1.delete and p1.status.unreferenced_since
    p2 = plan_archive(_obs(status=p1.status, references=0, now=NOW + timedelta(hours=2)), BACKOFF)
    assert p2.delete
    p3 = plan_archive(_obs(status=p1.status, references=1, now=NOW + timedelta(hours=2)), BACKOFF)
    assert not p3.delete and p3.status.unreferenced_since is None


def test_available_keeps_the_save_pods_durations() -> None:
    info = ManifestInfo(uri="s3://b/p/archives/x/manifest", digest="d" * 64, bytes=10)
    result = SaveResult(succeeded=True, durations={"capture": 3.0})
    obs = _obs(probe=StoreProbe(manifest=info), jobs=_job(0, "Succeeded"), result=result)
    plan = plan_archive(obs, BACKOFF)
    assert plan.status.durations == {"capture": 3.0}


def test_store_blip_while_the_save_runs_stays_saving() -> None:
    """StoreUnreachable during a running SAVE is not a failing archive (no native pods start)."""
    started = plan_archive(_obs(), BACKOFF)
    blip = plan_archive(_obs(status=started.status, jobs=_job(0, "Active"),
                             probe=StoreProbe(unreachable="connect timeout")), BACKOFF)
    assert blip.status.phase is GAPhase.saving and _saved(blip) == ("False", "StoreUnreachable")
    assert blip.create_job_attempt is None and blip.requeue_after == 10
    back = plan_archive(_obs(status=blip.status, jobs=_job(0, "Active")), BACKOFF)
    assert back.status.phase is GAPhase.saving and _saved(back) == ("False", "SaveRunning")


def _available(digest: str = "d" * 64) -> tuple[ManifestInfo, GraphArchiveStatus]:
    info = ManifestInfo(uri="s3://ember/ember/archives/x/manifest", digest=digest, bytes=10, graphs=4)
    return info, plan_archive(_obs(probe=StoreProbe(manifest=info)), BACKOFF).status


def test_garbage_manifest_is_failed_with_the_reason() -> None:
    plan = plan_archive(_obs(probe=StoreProbe(invalid="not JSON")), BACKOFF)
    assert plan.status.phase is GAPhase.failed and _saved(plan) == ("False", "ManifestInvalid")
    assert "not JSON" in (plan.status.failure_reason or "") and plan.create_job_attempt is None
    assert plan.status.uri is None and plan.requeue_after == 10


def test_manifest_deleted_after_available_saves_again() -> None:
    _, status = _available()
    status.save_job, status.attempt = naming.save_job_name(HASH, 0), 0
    plan = plan_archive(_obs(status=status, probe=StoreProbe(), jobs=_job(0, "Succeeded")), BACKOFF)
    assert plan.status.phase is GAPhase.saving and plan.status.uri is None and plan.status.digest is None
    assert plan.create_job_attempt == 1
    assert any(e.reason == "ManifestDeleted" and e.type == "Warning" for e in plan.events)


def test_manifest_replaced_after_available_gets_the_new_digest_and_a_warning() -> None:
    info, status = _available("a" * 64)
    swapped = StoreProbe(manifest=replace(info, digest="b" * 64))
    plan = plan_archive(_obs(status=status, probe=swapped), BACKOFF)
    assert plan.status.phase is GAPhase.available and plan.status.digest == "b" * 64
    assert any(e.reason == "ManifestReplaced" for e in plan.events)


def test_store_blip_after_available_keeps_it_available() -> None:
    _, status = _available()
    plan = plan_archive(_obs(status=status, probe=StoreProbe(unreachable="timeout")), BACKOFF)
    assert plan.status.phase is GAPhase.available and plan.status.uri


def test_save_nobody_wants_stops_at_once_and_is_collected_after_the_grace() -> None:
    """Two quick edits: the in-between identity's SAVE Job is deleted, no retry, GC after grace."""
    saving = plan_archive(_obs(), BACKOFF).status
    p1 = plan_archive(_obs(status=saving, references=0, jobs=_job(0, "Active")), BACKOFF)
    assert p1.delete_jobs and not p1.delete and p1.create_job_attempt is None
    assert _saved(p1) == ("False", "Unreferenced") and p1.status.phase is GAPhase.pending
    failed = plan_archive(_obs(status=p1.status, references=0, jobs=_job(0, "Failed"),
                               now=NOW + timedelta(seconds=5)), BACKOFF)
    assert failed.create_job_attempt is None and not failed.delete  # no retry for nobody
    gone = plan_archive(_obs(status=p1.status, references=0, now=NOW + timedelta(seconds=31)), BACKOFF)
    assert gone.delete
    # Available archives keep the retention period.
    info = ManifestInfo(uri="s3://ember/ember/archives/x/manifest", digest="d" * 64, bytes=10)
    avail = plan_archive(_obs(probe=StoreProbe(manifest=info)), BACKOFF).status
    kept = plan_archive(_obs(status=avail, references=0, probe=StoreProbe(manifest=info),
                             now=NOW + timedelta(seconds=31)), BACKOFF)
    assert not kept.delete and not kept.delete_jobs


def test_unschedulable_or_uncreatable_save_pod_is_not_running() -> None:
    from ember_operator.jobs import pod_stuck

    pod = {"status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."}]}}
    why = pod_stuck(pod)
    assert why.startswith("Unschedulable: 0/3 nodes") and pod_stuck({"status": {"phase": "Running"}}) == ""
    started = plan_archive(_obs(), BACKOFF).status
    stuck = ("SaveUnschedulable", why)
    plan = plan_archive(_obs(status=started, jobs=_job(0, "Active"), stuck=stuck), BACKOFF)
    assert plan.status.phase is GAPhase.saving and _saved(plan) == ("False", "SaveUnschedulable")
    assert "cannot run: Unschedulable: 0/3 nodes" in plan.status.conditions[0].message
    assert any(e.type == "Warning" and e.reason == "SaveUnschedulable" for e in plan.events)
    created = plan_archive(_obs(status=started, jobs=_job(0, "Active"),
                                stuck=("SaveFailedCreate", "FailedCreate: quota exceeded")), BACKOFF)
    assert _saved(created) == ("False", "SaveFailedCreate")


def test_save_job_refused_by_the_apiserver_is_a_failed_attempt_with_the_reason() -> None:
    from ember_operator.archive_planning import job_refused

    obs = _obs()
    plan = plan_archive(obs, BACKOFF)
    job_refused(obs, plan, BACKOFF, "SAVE Job j refused by the API server (403): exceeded quota: q")
    assert plan.create_job_attempt is None and plan.status.phase is GAPhase.failed
    assert _saved(plan) == ("False", "CreateRejected") and plan.requeue_after == 10
    assert any(e.type == "Warning" and e.reason == "CreateRejected" for e in plan.events)
    # The next pass (no Job exists) keeps the reason until the retry creates the next attempt.
    again = plan_archive(_obs(status=plan.status, now=NOW + timedelta(seconds=5)), BACKOFF)
    assert _saved(again) == ("False", "CreateRejected") and "exceeded quota" in again.status.failure_reason
    retry = plan_archive(_obs(status=plan.status, now=NOW + timedelta(seconds=11)), BACKOFF)
    assert retry.create_job_attempt == 1
