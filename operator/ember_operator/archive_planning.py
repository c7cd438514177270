"""Pure planning for a GraphArchive: store probe + SAVE Jobs in, Job to create and status out.

Order of checks (each failing one is a reason on the `Saved` condition plus a retry time):
0. the namespace may use the store at all (tenancy.py: endpoint allow-list, the operator's own
   credentials, local store root), else Failed with that reason and nothing is connected to;
1. the credentials Secret exists (CredentialsSecretMissing);
2. the store answers (StoreUnreachable);
3. the manifest is in the store → Available, no Job at all (another namespace, an earlier
   operator, or this archive's own SAVE put it there); a manifest that does not parse is Failed
   (ManifestInvalid). Once Available the store is still probed on every pass: a manifest deleted
   since is no longer Available (a new SAVE attempt starts), one replaced since gets its new digest
   (claims pin it, so pods of the old digest are rolled) and a Warning event;
4. otherwise the SAVE Job of the current attempt: created when missing (name from the identity
   hash and the attempt, so a restarted operator never creates a second), Saving while it runs,
   Failed with the pod's termination message when it fails, a new attempt after the backoff.
A succeeded Job whose manifest does not show up within the grace period is a failure too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ember.contract import SaveResult
from ember.identity import digest_short
from ember_operator import conditions, naming
from ember_operator.api import CompatKeySummary, GAPhase, GraphArchiveSpec, GraphArchiveStatus
from ember_operator.conditions import Event, parse_time, rfc3339
from ember_operator.jobs import job_failure, job_state

SAVED = "Saved"
CREATE_REJECTED = "CreateRejected"  # the apiserver refused the SAVE Job (4xx)


@dataclass(frozen=True)
class ManifestInfo:
    uri: str
    digest: str
    bytes: int
    graphs: int | None = None
    compat: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoreProbe:
    """What the store said (None fields: not asked)."""

    secret_missing: bool = False
    unreachable: str = ""  # error text when the store could not be used
    manifest: ManifestInfo | None = None
    invalid: str = ""  # the manifest exists but does not parse: why
    refused: tuple[str, str] | None = None  # (reason, message): this namespace may not use the store


@dataclass(frozen=True)
class Backoff:
    base_s: float = 10.0
    max_s: float = 600.0
    grace_s: float = 30.0
    retention_s: float = 86400.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * (2 ** max(0, attempt)))


@dataclass
class ArchiveObserved:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: GraphArchiveSpec
    status: GraphArchiveStatus
    probe: StoreProbe
    now: datetime
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    result: SaveResult | None = None  # termination message of the current attempt's pod
    # Why the current attempt's Job runs nothing: ("SaveUnschedulable" | "SaveFailedCreate", text)
    stuck: tuple[str, str] | None = None
    references: int = 1


@dataclass
class ArchivePlan:
    status: GraphArchiveStatus
    events: list[Event] = field(default_factory=list)
    create_job_attempt: int | None = None
    delete: bool = False
    delete_jobs: bool = False  # nobody wants this identity any more: its SAVE Jobs go now
    requeue_after: float | None = None
    saved_now: bool = False  # the archive became Available in this pass
    save_failed_now: bool = False


def plan_archive(obs: ArchiveObserved, backoff: Backoff) -> ArchivePlan:
    st = obs.status.model_copy(deep=True)
    plan = ArchivePlan(status=st)
    st.observed_generation = obs.generation
    if _collect_garbage(obs, plan, backoff):
        return plan

    probe = obs.probe
    available = st.phase is GAPhase.available
    if probe.refused is not None:
        # Not the store's fault: never connected to, no SAVE Job; Failed until the spec or the
        # admin's settings change (deployments show the same reason).
        _failed_probe(obs, plan, backoff, *probe.refused)
    elif probe.manifest is not None:
        _manifest_found(obs, plan, probe.manifest)
    elif probe.invalid:
        detail = f"manifest in {obs.spec.store.uri()} is not a readable ember manifest: {probe.invalid}"
        _failed_probe(obs, plan, backoff, "ManifestInvalid", detail)
    elif available and (probe.unreachable or probe.secret_missing):
        pass  # already Available: a store blip does not take that back (pods retry their fetches)
    elif available and not (probe.secret_missing or probe.unreachable):
        _manifest_lost(obs, plan, backoff)
    elif probe.secret_missing:
        secret = obs.spec.store.credentials_secret
        _store_trouble(obs, plan, backoff, "CredentialsSecretMissing",
                       f"credentials Secret {secret!r} not found in namespace {obs.namespace}: "
                       "create it there with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    elif probe.unreachable:
        message = (f"store {obs.spec.store.uri()} unreachable: {probe.unreachable}; check "
                   "spec.store (bucket, endpoint) and that the operator can reach it")[:1024]
        if _save_in_flight(obs):
            # A blip while the SAVE runs: the Job may still write the manifest. Stay Saving (not
            # failing: deployments keep waiting instead of starting native pods), look again soon.
            _set_saved(obs, plan, False, "StoreUnreachable", f"SAVE Job {st.save_job} running; {message}")
            _retry_in(obs, plan, backoff.base_s)
        else:
            _store_trouble(obs, plan, backoff, "StoreUnreachable", message)
    else:
        _plan_save(obs, plan, backoff)

    old_phase = obs.status.phase
    plan.events += conditions.transitions(obs.status.conditions, st.conditions)
    if old_phase != st.phase and st.phase is not None:
        plan.events.append(Event("Normal" if st.phase is not GAPhase.failed else "Warning", "Phase",
                                 f"phase {old_phase.value if old_phase else 'None'} → {st.phase.value}"))
    return plan


def _save_in_flight(obs: ArchiveObserved) -> bool:
    """The current attempt's SAVE Job exists and has not failed."""
    st = obs.status
    job = obs.jobs.get(st.save_job or "")
    return st.phase is GAPhase.saving and job is not None and job_state(job) != "Failed"


def _collect_garbage(obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff) -> bool:
    """The GC clock: an archive nobody uses (no ModelDeployment, no serving pod of its identity)
    is deleted after the retention period. One that is not Available stops saving at once (an
    in-between identity of two quick edits must not SAVE for nobody) and goes after the manifest
    grace period. True: planning stops here."""
    st, now = plan.status, obs.now
    if obs.references > 0:
        st.unreferenced_since = None
        return False
    since = parse_time(st.unreferenced_since) or now
    st.unreferenced_since = rfc3339(since)
    unused = st.phase is not GAPhase.available
    keep = min(backoff.retention_s, backoff.grace_s) if unused else backoff.retention_s
    if unused:
        plan.delete_jobs = bool(obs.jobs)
        if st.phase is GAPhase.saving:
            st.phase = GAPhase.pending
        st.next_retry_time = None
        _set_saved(obs, plan, False, "Unreferenced",
                   "no ModelDeployment uses this identity: SAVE stopped, the archive is collected")
    if backoff.retention_s > 0 and (now - since).total_seconds() >= keep:
        plan.delete = True
        plan.events.append(Event("Normal", "GarbageCollected", f"unreferenced for {keep:.0f}s; deleting"))
        return True
    return unused


def _set_saved(obs: ArchiveObserved, plan: ArchivePlan, ok: bool | None, reason: str, message: str) -> None:
    st = plan.status
    st.conditions = conditions.put(st.conditions, SAVED, ok, reason, message, obs.generation, obs.now)


def _retry_in(obs: ArchiveObserved, plan: ArchivePlan, delay: float, renew: bool = True) -> None:
    """Schedule the next try; `renew` moves a retry time that has passed (probe failures)."""
    st, now = plan.status, obs.now
    retry_at = parse_time(st.next_retry_time)
    if retry_at is None or (renew and retry_at < now):
        retry_at = now + timedelta(seconds=delay)
        st.next_retry_time = rfc3339(retry_at)
    plan.requeue_after = max(1.0, (retry_at - now).total_seconds())


def _manifest_found(obs: ArchiveObserved, plan: ArchivePlan, manifest: ManifestInfo) -> None:
    st = plan.status
    if st.phase is not GAPhase.available:
        plan.saved_now = True
        st.completion_time = rfc3339(obs.now)
    elif st.digest and st.digest != manifest.digest:
        plan.events.append(Event("Warning", "ManifestReplaced",
                                 f"manifest {manifest.uri} was replaced: digest {digest_short(st.digest)}… "
                                 f"→ {digest_short(manifest.digest)}…; pods pinned to the old digest are "
                                 "replaced"))
    st.phase = GAPhase.available
    st.uri, st.digest, st.bytes = manifest.uri, manifest.digest, manifest.bytes
    st.graphs = manifest.graphs
    st.compat_key = CompatKeySummary.model_validate(manifest.compat) if manifest.compat else st.compat_key
    st.failure_reason = None
    st.next_retry_time = None
    if obs.result is not None and obs.result.succeeded and obs.result.durations:
        st.durations = obs.result.durations  # the SAVE pod's own stage timings
    _set_saved(obs, plan, True, "ManifestFound", f"archive at {manifest.uri}")


def _manifest_lost(obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff) -> None:
    """Available before, no manifest now (deleted from the store): SAVE again as a new attempt."""
    st = plan.status
    lost = st.uri
    st.uri, st.digest, st.bytes, st.graphs, st.completion_time = None, None, None, None, None
    st.phase = GAPhase.pending
    if st.save_job:
        st.attempt += 1  # the old attempt's Job succeeded; a new one writes the archive again
    plan.events.append(Event("Warning", "ManifestDeleted",
                             f"manifest {lost} is gone from the store; saving it again"))
    _plan_save(obs, plan, backoff)


def _failed_probe(
    obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff, reason: str, message: str
) -> None:
    """The store answers but what it holds is unusable: Failed (deployments serve natively)."""
    st = plan.status
    if st.phase is not GAPhase.failed:
        plan.save_failed_now = True
        st.next_retry_time = None
    st.phase = GAPhase.failed
    st.uri, st.digest = None, None
    st.failure_reason = message[:1024]
    _retry_in(obs, plan, backoff.base_s)
    _set_saved(obs, plan, False, reason, st.failure_reason)


def _store_trouble(
    obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff, reason: str, message: str
) -> None:
    """The store cannot be used (credentials, reachability): Pending, retried soon."""
    st = plan.status
    st.phase = GAPhase.pending
    st.failure_reason = message
    _retry_in(obs, plan, backoff.base_s)
    _set_saved(obs, plan, False, reason, message)


def _plan_save(obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff) -> None:
    """No manifest yet: the current attempt's SAVE Job decides (create, wait, fail, retry)."""
    st = plan.status
    attempt = st.attempt
    job_name = naming.save_job_name(obs.spec.identity_hash, attempt)
    job = obs.jobs.get(job_name)
    if job is None and not (st.phase is GAPhase.failed and st.save_job == job_name):
        st.failure_reason = None
        _create_job(obs, plan, attempt, f"SAVE Job {job_name} (attempt {attempt}) created")
        return
    # A failed Job that was removed by hand counts as failed: retried on schedule.
    state = job_state(job) if job is not None else "Failed"
    st.save_job = job_name
    if state == "Active":
        st.phase = GAPhase.saving
        if obs.stuck is not None:
            # Not "running": its pod cannot be scheduled or created. Said as it is; the Job's own
            # deadline (activeDeadlineSeconds) ends the attempt, then the usual backoff.
            reason, why = obs.stuck
            _set_saved(obs, plan, False, reason, f"SAVE Job {job_name} (attempt {attempt}) "
                       f"cannot run: {why}"[:1024])
            plan.requeue_after = backoff.base_s
            return
        _set_saved(obs, plan, False, "SaveRunning", f"SAVE Job {job_name} (attempt {attempt}) running")
        return
    if state == "Succeeded":
        done = parse_time(((job or {}).get("status") or {}).get("completionTime")) or obs.now
        if (obs.now - done).total_seconds() < backoff.grace_s:
            st.phase = GAPhase.saving
            _set_saved(obs, plan, False, "Verifying",
                       f"SAVE Job {job_name} succeeded; waiting for its manifest")
            plan.requeue_after = 1.0
            if obs.result is not None:
                st.durations = obs.result.durations or st.durations
            return
        reason = f"SAVE Job {job_name} succeeded but no manifest appeared in {obs.spec.store.uri()}"
        _failed_attempt(obs, plan, backoff, reason, "ManifestMissing")
    elif job is None and (prev := conditions.get(st.conditions, SAVED)) is not None \
            and prev.reason == CREATE_REJECTED and st.failure_reason:
        _failed_attempt(obs, plan, backoff, st.failure_reason, CREATE_REJECTED)  # never created
    else:
        detail = (obs.result.reason if obs.result is not None else "") or job_failure(job or {}) or "failed"
        _failed_attempt(obs, plan, backoff, f"SAVE Job {job_name} failed: {detail}", "SaveFailed")


def job_refused(obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff, why: str) -> None:
    """The apiserver refused the SAVE Job the plan creates (invalid, admission, quota): that
    attempt failed (Failed, CreateRejected, the API's message) and is retried after the backoff
    like a failed SAVE; deployments serve natively meanwhile."""
    before = list(plan.status.conditions)
    plan.create_job_attempt = None
    _failed_attempt(obs, plan, backoff, why, CREATE_REJECTED)
    plan.events += conditions.transitions(before, plan.status.conditions)


def _create_job(obs: ArchiveObserved, plan: ArchivePlan, attempt: int, message: str) -> None:
    st = plan.status
    plan.create_job_attempt = attempt
    st.save_job = naming.save_job_name(obs.spec.identity_hash, attempt)
    st.save_started_time = rfc3339(obs.now)
    st.phase = GAPhase.saving
    st.next_retry_time = None
    _set_saved(obs, plan, False, "SaveRunning", message)


def _failed_attempt(
    obs: ArchiveObserved, plan: ArchivePlan, backoff: Backoff, reason: str, kind: str
) -> None:
    """Failed: wait out the backoff, then start the next attempt."""
    st = plan.status
    attempt = st.attempt
    if st.phase is not GAPhase.failed:
        plan.save_failed_now = True
        st.phase = GAPhase.failed
        st.next_retry_time = None
    st.failure_reason = reason[:1024]
    _retry_in(obs, plan, backoff.delay(attempt), renew=False)
    retry_at = parse_time(st.next_retry_time)
    if retry_at is not None and obs.now >= retry_at:
        st.attempt = attempt + 1
        job_name = naming.save_job_name(obs.spec.identity_hash, st.attempt)
        _create_job(obs, plan, st.attempt, f"retrying: SAVE Job {job_name} (attempt {st.attempt}) created")
        plan.requeue_after = None
        return
    _set_saved(obs, plan, False, kind, f"{reason}; retrying at {st.next_retry_time}")
