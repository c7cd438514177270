"""Pure planning for a ModelDeployment: observed objects in, desired changes and status out.

`plan_deployment(observed, ctx)` is the whole decision: which GraphArchive must exist, which warm
pods to claim, which cold pods to create or delete, the HPA, the status (conditions first, the
phase derived from them) and the events. It does no I/O, so every branch is unit-tested without
a cluster; `reconcilers` reads the observation and applies the plan.

Rules, in order:
1. The archive identity comes from the spec (`ModelDeploymentSpec.identity`); its GraphArchive is
   created when missing.
2. New pods of the current revision are started only when the archive is Available (they restore)
   or is failing (credentials, store, SAVE: they serve with native capture). While a SAVE runs,
   the deployment waits (phase Saving) — or keeps serving from the previous revision
   (phase Reconfiguring).
3. Missing pods are claimed from the warm pool first (ready pods first), then created cold.
4. Old-revision pods are deleted as current-revision pods become ready (a rolling move). Once the
   archive is Available, pods that do not restore it (native-capture pods started while it was
   failing, pods pinned to a manifest digest that was since replaced) count as old: they are
   rolled onto restoring pods the same way.
5. Availability comes from the pods' own claims and restore results (`ember.dev/archive` and
   `ember.dev/restore`), never from the archive's phase alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ember import contract
from ember.archive import signing
from ember.contract import Claim
from ember.engines.vllm import args as vllm_args
from ember.identity import ArchiveIdentity, canonical_json, identity_short
from ember_operator import conditions, hpas, naming, switching, templates, tenancy
from ember_operator.api import (
    ArchiveRef,
    GraphArchiveSpec,
    IdentitySpec,
    MDPhase,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    SaveSpec,
    ShapeSpec,
    StoreSpec,
)
from ember_operator.conditions import Event
from ember_operator.observed import ArchiveView, PodView
from ember_operator.phases import (  # noqa: F401  (derive_phase, REFUSED_REASONS: re-exported)
    ARCHIVE_READY,
    AVAILABLE,
    INVALID_SPEC,
    PROGRESSING,
    REFUSED_REASONS,
    derive_phase,
    settle,
)
from ember_operator.pods import PodTemplate, StoreAccess, bound_key, claim_patch, serving_pod
from ember_operator.tenancy import Refused, Tenancy, store_refusal


@dataclass(frozen=True)
class Context:
    """Operator-wide inputs of planning (from Settings)."""

    sidecar_image: str
    default_store: str = ""
    default_s3_endpoint: str = ""
    pod_service_account: str = ""
    signing_secret: str = ""  # for deployments that name no signing Secret
    local_store_root: str = "/var/lib/ember"  # spec'd local stores must lie under it
    presave_priority_class: str = ""  # priorityClassName of SAVE Jobs for alternatives ("" → none)
    warm_priority_class: str = ""  # of warm pods: serving pods preempt them ("" → default priority)
    serving_priority_class: str = ""  # of cold serving pods ("" → default priority)
    pod_batch: int = 500  # most pods one pass creates or deletes (the rest in the next passes)
    store_endpoints: tuple[str, ...] = ()  # S3 endpoints specs may name (tenancy.py); () → the default's
    credential_namespaces: tuple[str, ...] = ()  # may use the operator's own store credentials

    @property
    def tenancy(self) -> Tenancy:
        return Tenancy(self.default_store, self.default_s3_endpoint, self.local_store_root,
                       self.store_endpoints, self.credential_namespaces)


@dataclass
class Observed:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus
    now: datetime
    archive: ArchiveView | None = None
    pods: list[PodView] = field(default_factory=list)  # serving pods of this deployment
    warm: list[PodView] = field(default_factory=list)  # unclaimed warm pods of its pool
    bound: list[PodView] = field(default_factory=list)  # its identity-keyed warm pods (every shape)
    hpa: dict[str, Any] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    draining: list[PodView] = field(default_factory=list)  # pods taken out of service (pool=draining)
    # GraphArchives of the alternative shapes, by identity hash (None: not created yet)
    alt_archives: dict[str, ArchiveView | None] = field(default_factory=dict)
    warm_pending: list[PodView] = field(default_factory=list)  # unscheduled warm pods of its pools


@dataclass
class Plan:
    status: ModelDeploymentStatus
    events: list[Event] = field(default_factory=list)
    archive_create: dict[str, Any] | None = None
    claims: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (pod name, merge patch)
    creates: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    hpa_apply: dict[str, Any] | None = None
    hpa_delete: bool = False
    labels: dict[str, str | None] = field(default_factory=dict)  # label changes (None removes)
    claim: Claim | None = None  # what claims and new pods carry (replacements of lost claims too)
    presaves: list[dict[str, Any]] = field(default_factory=list)  # GraphArchives of alternatives
    drains: list[str] = field(default_factory=list)  # serving pods to take out of service
    undrains: list[str] = field(default_factory=list)  # draining pods to put back (an edit back)
    requeue_after: float | None = None  # look again then (a drain's grace period ends)
    unschedulable: tuple[str, str] | None = None  # Schedulable=False (reason, message) from its pods


def store_of(spec: ModelDeploymentSpec, ctx: Context, namespace: str) -> StoreSpec:
    """The deployment's store; raises `Refused` when `namespace` may not use it (tenancy.py)."""
    store = spec.store if spec.store is not None else ctx.tenancy.default()
    if refusal := store_refusal(store, namespace, ctx.tenancy):
        raise Refused(*refusal)
    return store


def template_of(
    namespace: str, spec: ModelDeploymentSpec, ctx: Context, shape: ShapeSpec | None = None,
) -> PodTemplate:
    """The pods of `spec` in `shape` (the current one by default): one pod of tensor × data GPUs."""
    return PodTemplate(
        namespace=namespace,
        gpu_product=spec.gpu.product,
        gpu_count=spec.gpu_count(shape),
        engine_kind=spec.engine.kind.value,
        engine_version=spec.engine.version,
        engine_image=spec.engine.image,
        sidecar_image=ctx.sidecar_image,
        store=StoreAccess.of(store_of(spec, ctx, namespace)),
        service_account=ctx.pod_service_account,
        trusted_keys=trusted_keys_env(spec),
        patch=templates.encode(spec.template),
        warm_priority_class=ctx.warm_priority_class, serving_priority_class=ctx.serving_priority_class,
        serve_args=() if spec.engine.kind.value == "vllm" else engine_args(spec),
        **_engine_resources(spec),
    )


def engine_args(
    spec: ModelDeploymentSpec, ident: ArchiveIdentity | None = None, shape: ShapeSpec | None = None,
) -> tuple[str, ...]:
    """The claim's engine arguments (an identity-keyed warm pod carries them from its creation, a
    template-keyed one learns them with the claim): for vLLM
    (`ember serve --engine vllm` starts `vllm serve` after the hand-off) the identity's arguments
    come first (model, capture sizes, graph mode, batch limits, parallel sizes: what the SAVE Job
    ran, so LOAD's sizing check passes), then the deployment's own (`engine_run_args`: with vLLM's
    sleep mode for a sleeping warm pool), with vLLM's data-parallel size where `shape` (default: the
    current one) serves its archive in several replicas (`vllm_args.pod_args`). `ident`:
    spec.identity(shape), when the caller has it.
    transformers: its `ember serve` arguments (`contract.serve_args`: the model, then engine.args),
    which its pods' command runs from their creation (`PodTemplate.serve_args`): the claim says
    what the pod serves, and `ember serve` refuses a claim of other arguments."""
    if spec.engine.kind.value == "vllm":
        data = (shape or spec.parallelism).data
        return (*vllm_args.pod_args(ident or spec.identity(shape), data), *spec.engine_run_args())
    return tuple(contract.serve_args(spec.model.name, spec.engine_run_args()))


def trusted_keys_env(spec: ModelDeploymentSpec) -> str:
    """EMBER_TRUSTED_KEYS for the deployment's pods ("" when it trusts no key: not checked)."""
    keys = spec.archive.signing.trusted_keys
    return signing.trusted_keys_json([(k.id, k.public_key) for k in keys]) if keys else ""


def _engine_resources(spec: ModelDeploymentSpec) -> dict[str, tuple[tuple[str, str], ...]]:
    res = spec.engine.resources
    return {"engine_requests": tuple(sorted(res.requests.items())),
            "engine_limits": tuple(sorted(res.resolved_limits().items()))}


def revision_of(identity_hash: str, template: PodTemplate, spec: ModelDeploymentSpec) -> str:
    """Pods of another revision are rolled: identity, pool template or engine args changed."""
    return naming.short_hash(identity_hash, template.pool_key, spec.engine_run_args(), length=10)


def archive_object(
    name: str, namespace: str, spec: ModelDeploymentSpec, ctx: Context, shape: ShapeSpec | None = None,
    priority_class: str = "",
) -> dict[str, Any]:
    ident = spec.identity(shape)
    ga = GraphArchiveSpec(
        identity_hash=ident.hash(),
        identity=IdentitySpec.of(ident),
        store=store_of(spec, ctx, namespace),
        save=SaveSpec(
            image=spec.engine.image, args=spec.engine_run_args(),
            pod_annotations=dict(spec.save.pod_annotations), timeout_seconds=spec.save.timeout_seconds,
            signing_secret=spec.archive.signing.secret_name or ctx.signing_secret or None,
            priority_class_name=priority_class or None,
            resources=spec.engine.resources, template=spec.template,
        ),
    )
    return {
        "apiVersion": contract.API_VERSION,
        "kind": "GraphArchive",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR,
                contract.LABEL_IDENTITY: ident.short(),
                contract.LABEL_GPU_PRODUCT: spec.gpu.product,
            },
        },
        "spec": ga.wire(),
    }


def _deletion_order(pods: list[PodView]) -> list[PodView]:
    """Which pods go first when scaling down: not ready, fallen back, then newest."""
    return sorted(pods, key=lambda p: (p.ready, not p.fell_back, p.created, p.name), reverse=False)


def free_names(md_name: str, revision: str, taken: set[str], count: int) -> list[str]:
    names: list[str] = []
    i = 0
    while len(names) < count:
        candidate = naming.serving_pod_name(md_name, revision, i)
        if candidate not in taken:
            names.append(candidate)
        i += 1
    return names


def _archive_condition(archive: ArchiveView | None) -> tuple[bool | None, str, str]:
    if archive is None:
        return None, "ArchivePending", "GraphArchive created; waiting for its first reconcile"
    if archive.available:
        return True, "ArchiveAvailable", f"restoring from {archive.uri}"
    if archive.failing:
        own_reasons = ("CredentialsSecretMissing", "StoreUnreachable", "ManifestInvalid", "CreateRejected",
                       *tenancy.REASONS)
        reason = archive.reason if archive.reason in own_reasons else "SaveFailed"
        retry = f"; retrying at {archive.next_retry_time}" if archive.next_retry_time else ""
        return False, reason, f"{archive.message or archive.phase}; serving with native capture{retry}"
    if archive.phase == "Saving" and archive.reason in ("SaveUnschedulable", "SaveFailedCreate"):
        return False, archive.reason, archive.message
    if archive.phase == "Saving":
        return False, "Saving", f"SAVE Job running for {archive.name}"
    return False, "ArchivePending", f"{archive.name} is {archive.phase}"


def plan_deployment(obs: Observed, ctx: Context) -> Plan:
    """The whole decision for one ModelDeployment (see the module docstring for the rules)."""
    spec = obs.spec
    ident = spec.identity()
    ident_hash = ident.hash()
    template = template_of(obs.namespace, spec, ctx)
    revision = revision_of(ident_hash, template, spec)
    plan = Plan(status=obs.status.model_copy(deep=True))

    if obs.labels.get(contract.LABEL_IDENTITY) != ident.short():
        plan.labels[contract.LABEL_IDENTITY] = ident.short()
    archive = obs.archive
    if archive is None:
        plan.archive_create = archive_object(naming.archive_name(ident_hash), obs.namespace, spec, ctx)
    low = ctx.presave_priority_class
    for shape, name in switching.shapes_and_labels(obs, plan, archive):
        plan.presaves.append(archive_object(name, obs.namespace, spec, ctx, shape, low))

    arch_condition = _archive_condition(archive)
    # claimed_at is written with microseconds: the sidecar times from it
    plan.claim = claim_for(obs.name, spec, archive, arch_condition[1], revision=revision,
                           claimed_at=obs.now.timestamp())
    rollout = _plan_pods(obs, plan, plan.claim, template)
    _batch(plan, ctx.pod_batch)
    plan.unschedulable = unschedulable(obs)
    _set_replica_status(obs, plan, rollout)
    old = [p for p in rollout.remaining if not rollout.is_current(p)]
    rollout.previous = switching.previous_shape(obs, plan, old)
    _set_conditions(obs, plan, rollout, arch_condition)
    ready_new = sum(p.ready for p in rollout.remaining if rollout.is_current(p)) + rollout.claimed_ready
    presaved = archive is not None and archive.available
    switching.switch_status(obs, plan, rollout.previous, ready_new, len(old), presaved)
    _plan_hpa(obs, plan)
    return plan


def claim_for(
    deployment: str, spec: ModelDeploymentSpec, archive: ArchiveView | None, native_reason: str = "",
    shape: ShapeSpec | None = None, *, revision: str = "", claimed_at: float | None = None,
) -> Claim:
    """What a pod of `deployment` in `shape` is claimed with (a pod of N GPUs is rank 0 of world N:
    its ranks 0..N-1): `archive` when it is Available, else native capture for `native_reason`.
    Without `revision` and `claimed_at`, the hand-off data an identity-keyed warm pod is created
    with (`pools.pool_wants`)."""
    ident = spec.identity(shape)
    uri = archive.uri if archive is not None and archive.available else ""
    return Claim(
        archive_uri=uri, identity=ident.hash(), claimed_at=claimed_at, deployment=deployment,
        revision=revision, rank=0, world=spec.gpu_count(shape),
        identity_spec=canonical_json(ident.canonical()).decode(), engine_args=engine_args(spec, ident, shape),
        native_reason="" if uri else native_reason,
        manifest_digest=archive.digest if archive is not None and uri else "",
    )


def _batch(plan: Plan, size: int) -> None:
    """At most `size` pods created and `size` deleted per pass (10,000 → 1 is many passes, each
    writing status): the rest follow at once in the next pass."""
    if len(plan.creates) > size or len(plan.deletes) > size:
        plan.creates, plan.deletes = plan.creates[:size], plan.deletes[:size]
        plan.requeue_after = 0.1


PODS_UNSCHEDULABLE = "PodsUnschedulable"
WARM_PODS_UNSCHEDULABLE = "WarmPodsUnschedulable"


def unschedulable(obs: Observed) -> tuple[str, str] | None:
    """Schedulable=False from what the scheduler says about the deployment's serving pods and the
    warm pods of its pools: (reason, message naming the pods with the scheduler's message)."""
    serving = [p for p in obs.pods if p.unschedulable and not p.deleting]
    warm = [p for p in obs.warm_pending if p.unschedulable and not p.deleting]
    if not serving and not warm:
        return None
    by_message: dict[str, list[str]] = {}
    for pod in sorted(serving, key=lambda p: p.name) + sorted(warm, key=lambda p: p.name):
        by_message.setdefault(pod.unschedulable, []).append(pod.name)
    parts = []
    for message, names in by_message.items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        parts.append(f"{shown}: {message.strip()}")
    what = f"{len(serving)} serving pod(s)" if serving else ""
    what += (" and " if serving and warm else "") + (f"{len(warm)} warm pod(s)" if warm else "")
    reason = PODS_UNSCHEDULABLE if serving else WARM_PODS_UNSCHEDULABLE
    return reason, f"{what} cannot be scheduled: " + "; ".join(parts)


@dataclass
class _Rollout:
    """What the pod plan decided, for the status and the conditions."""

    claim: Claim
    live: list[PodView]  # serving pods not being deleted (any revision)
    current: list[PodView]  # pods of the current revision that have not exited
    can_deploy: bool
    claimed: int = 0  # warm pods claimed in this pass
    claimed_ready: int = 0  # ... of which were ready
    remaining: list[PodView] = field(default_factory=list)  # live pods this plan keeps
    previous: ShapeSpec | None = None  # switching from this shape (pods of it still serve or drain)
    not_restoring: int = 0  # pods (kept or new) that capture natively: no archive, or fell back
    drained: int = 0  # pods this plan takes out of service

    @property
    def revision(self) -> str:
        return self.claim.revision

    def is_current(self, pod: PodView) -> bool:
        return is_current(pod, self.claim)


def is_current(pod: PodView, claim: Claim) -> bool:
    """The pod serves what this plan wants: its revision, and (archive Available) that archive at
    the pinned digest. Native pods are current while there is no archive to restore."""
    if pod.revision != claim.revision:
        return False
    if claim.native or not (pod.native or pod.archive_uri):
        return True  # no archive wanted, or a pod that predates the claim annotations
    return pod.archive_uri == claim.archive_uri and pod.manifest_digest == claim.manifest_digest


def _plan_pods(obs: Observed, plan: Plan, claim: Claim, template: PodTemplate) -> _Rollout:
    """Claims, cold pods, drains and deletions (rules 2-4; drains: `switching`)."""
    archive = obs.archive
    live = [p for p in obs.pods if not p.deleting]
    current = [p for p in live if is_current(p, claim)]
    # Deploy when pods can restore (Available) or must capture natively (failing). A retried SAVE
    # does not stop a deployment that already serves natively from scaling; one whose pods restored
    # an archive that is being saved again (its manifest was deleted) waits with its new pods.
    serves_natively = bool(current) and all(p.native for p in current)
    can_deploy = archive is not None and (archive.available or archive.failing or serves_natively)
    old = [p for p in live if not is_current(p, claim)]
    # Pods that exited (Failed/Succeeded) never come back: replace them.
    plan.deletes += [p.name for p in current if p.failed]
    current = [p for p in current if not p.failed]
    want = obs.spec.replicas
    if can_deploy:  # an edit back mid-switch: draining pods of this revision serve again
        back = switching.undrain(obs, plan, claim, want - len(current), is_current)
        current, live = current + back, live + back
    switching.expire_drains(obs, plan)
    rollout = _Rollout(claim, live, current, can_deploy)
    if not can_deploy:
        # Waiting for the archive: keep what serves, but never more than asked for.
        serving = _deletion_order(old + current)
        plan.deletes += [p.name for p in serving[: max(0, len(serving) - want)]]
        return rollout
    missing = want - len(current)
    if missing > 0:
        _claim_or_create(obs, plan, template, rollout, missing)
    elif missing < 0:
        plan.deletes += [p.name for p in _deletion_order(current)[: -missing]]
    # Old pods leave only as current ones are Ready: capacity never drops below `replicas`.
    ready_current = sum(p.ready for p in current)
    keep_old = max(0, want - ready_current)
    switching.take_out(obs, plan, _deletion_order(old)[: max(0, len(old) - keep_old)])
    return rollout


def _claim_or_create(
    obs: Observed, plan: Plan, template: PodTemplate, rollout: _Rollout, missing: int
) -> None:
    """Claim warm pods first — its identity-keyed warm pods of exactly this claim whose engine
    is ready, then template-keyed ones (ready ones first) — and create the rest cold. An
    identity-keyed pod still loading, crashed or of another identity is never claimed."""
    warm = claimable(obs, template, rollout.claim) + sorted(
        (p for p in obs.warm if not p.deleting and not p.failed and not p.engine_crashed),
        key=lambda p: (not p.ready, p.created, p.name))
    for pod in warm[:missing]:
        plan.claims.append((pod.name, claim_patch(rollout.claim, pod.resource_version, obs.uid)))
    rollout.claimed = min(missing, len(warm))
    rollout.claimed_ready = sum(p.ready for p in warm[:missing])
    taken = {p.name for p in obs.pods} | {p.name for p in obs.draining}
    for name in free_names(obs.name, rollout.revision, taken, missing - rollout.claimed):
        plan.creates.append(serving_pod(template, rollout.claim, name, obs.uid))


def claimable(obs: Observed, template: PodTemplate, claim: Claim) -> list[PodView]:
    """The deployment's identity-keyed warm pods that `claim` may take: its pool key (archive,
    digest, engine arguments, layout), the engine ready, not exited or deleting; oldest first."""
    key = bound_key(template.pool_key, obs.name, claim)
    return sorted((p for p in obs.bound if p.pool_key == key and p.engine_ready and not p.engine_crashed
                   and not p.deleting and not p.failed), key=lambda p: (p.created, p.name))


def _set_replica_status(obs: Observed, plan: Plan, rollout: _Rollout) -> None:
    """Replica counts, restore counts and the archive reference, as they will be after the plan."""
    deleted = set(plan.deletes) | set(plan.drains)
    rollout.drained = len(plan.drains)
    remaining = rollout.remaining = [p for p in rollout.live if p.name not in deleted]
    claimed, revision = rollout.claimed, rollout.revision
    st = plan.status
    st.observed_generation = obs.generation
    st.selector = naming.selector(obs.name)
    st.revision = revision
    st.replicas = len(remaining) + len(plan.creates) + claimed
    st.ready_replicas = sum(p.ready for p in remaining) + rollout.claimed_ready
    st.updated_replicas = sum(rollout.is_current(p) for p in remaining) + len(plan.creates) + claimed
    st.restored_replicas = sum(p.restored for p in remaining)
    st.fallback_count = sum(p.fell_back for p in remaining)
    new_native = len(plan.creates) + claimed if rollout.claim.native else 0
    st.native_replicas = sum(p.native for p in remaining) + new_native
    rollout.not_restoring = sum(p.native or p.fell_back for p in remaining) + new_native
    st.warm_claims += claimed
    taken = {name for name, _ in plan.claims}
    warm = [p for p in obs.bound if p.name not in taken and not p.deleting and not p.failed]
    st.warm_ready = sum(p.engine_ready and not p.engine_crashed for p in warm)
    st.warm_loading = sum(not p.engine_ready and not p.engine_crashed for p in warm)
    times = [t for p in remaining if p.restored and (t := p.restore_time)]
    if times:
        st.last_restore_time = max(times)
    ident_hash = rollout.claim.identity
    st.archive = ArchiveRef(
        name=naming.archive_name(ident_hash), identity_hash=ident_hash, uri=rollout.claim.archive_uri or None,
        phase=obs.archive.phase if obs.archive is not None else "Pending",
    )


_Condition = tuple[bool | None, str, str]  # status, reason, message


def _set_conditions(obs: Observed, plan: Plan, rollout: _Rollout, archive_ready: _Condition) -> None:
    """ArchiveReady, Available, Progressing; the phase derived from them; their events."""
    st = plan.status
    gen, now = obs.generation, obs.now
    conds = conditions.put(list(st.conditions), ARCHIVE_READY, *archive_ready, gen, now)
    conds = conditions.put(conds, AVAILABLE, *_available(obs, plan.status, rollout), gen, now)
    conds = conditions.put(conds, PROGRESSING, *_progressing(obs, plan.status, rollout), gen, now)
    st.conditions = conds
    old_phase = obs.status.phase
    settle(st, gen, now)
    plan.events = conditions.transitions(obs.status.conditions, st.conditions)
    # In-progress phases are the Progressing reason (already an event); settled ones get their own.
    if old_phase != st.phase and st.phase in (MDPhase.ready, MDPhase.degraded):
        plan.events.append(Event("Normal" if st.phase is MDPhase.ready else "Warning", "Phase",
                                 f"phase {old_phase.value if old_phase else 'None'} → {st.phase.value}"))
    if rollout.claimed:
        plan.events.append(Event("Normal", "Claimed", f"claimed {rollout.claimed} warm pod(s)"))


def _available(obs: Observed, st: ModelDeploymentStatus, rollout: _Rollout) -> _Condition:
    want = obs.spec.replicas
    if want == 0:
        return (True, "ScaledToZero", "replicas is 0")
    if st.ready_replicas == 0 and not rollout.can_deploy:
        return (False, "WaitingForArchive", f"0/{want} replicas ready; waiting for the archive")
    if st.ready_replicas == 0:
        return (False, "ReplicasNotReady", f"0/{want} replicas ready")
    # What the pods report (their claim, their sidecar's restore result), not the archive's phase.
    n = rollout.not_restoring
    if n:
        why = (f"{n}/{st.replicas} pod(s) serve with native capture ({st.native_replicas} claimed "
               f"without an archive, {st.fallback_count} fell back)")
        return (True, "NativeCapture" if n >= st.ready_replicas else "PartialFallback",
                f"{st.ready_replicas}/{want} replicas ready; {why}")
    return (True, "ReplicasReady", f"{st.ready_replicas}/{want} replicas ready")


def _progressing(obs: Observed, st: ModelDeploymentStatus, rollout: _Rollout) -> _Condition:
    want, archive, revision = obs.spec.replicas, obs.archive, rollout.revision
    ready_current = sum(p.ready for p in rollout.remaining if rollout.is_current(p)) + rollout.claimed_ready
    old_left = sum(not rollout.is_current(p) for p in rollout.remaining)
    can_deploy, ident_hash = rollout.can_deploy, rollout.claim.identity
    if archive is None or (not can_deploy and archive.phase == "Pending" and not old_left
                           and not rollout.current):
        return (True, MDPhase.pending.value, "waiting for the GraphArchive")
    if not can_deploy and old_left:
        return (True, MDPhase.reconfiguring.value,
                f"new identity {identity_short(ident_hash)}: SAVE running; "
                f"{old_left} pod(s) keep serving the previous one")
    if not can_deploy:
        return (True, MDPhase.saving.value, f"waiting for the SAVE of {naming.archive_name(ident_hash)}")
    stuck = [p.name for p in rollout.remaining if rollout.is_current(p) and p.unschedulable]
    why = (f"; stuck: {len(stuck)} new pod(s) cannot be scheduled ({', '.join(stuck[:3])}"
           f"{', …' if len(stuck) > 3 else ''}: see the Schedulable condition)") if stuck else ""
    if rollout.previous is not None:
        target = obs.spec.parallelism.shape().label()
        draining = len(obs.draining) + rollout.drained
        return (True, MDPhase.switching.value,
                f"{rollout.previous.label()} → {target}: {ready_current}/{want} new-shape replicas ready, "
                f"{old_left} old in service, {draining} draining{why}")
    if old_left:
        return (True, MDPhase.reconfiguring.value,
                f"moving pods to revision {revision}: {ready_current}/{want} ready, {old_left} old left{why}")
    if ready_current < want or st.updated_replicas != want or st.replicas != want:
        if ready_current == 0 and not any(p.ready for p in obs.pods):
            return (True, MDPhase.deploying.value, f"{ready_current}/{want} replicas ready{why}")
        return (True, MDPhase.scaling.value, f"{ready_current}/{want} replicas ready{why}")
    return (False, "Complete", f"{want} replica(s) of revision {revision} ready")


CREATE_REJECTED = "CreateRejected"


def refused_status(
    status: ModelDeploymentStatus, generation: int, now: datetime, reason: str, message: str,
) -> tuple[ModelDeploymentStatus, list[Event]]:
    """The status of a spec the operator refuses (it does nothing else with it): phase Invalid,
    `Progressing=False` with the reason, one Warning event when that changes."""
    st = status.model_copy(deep=True)
    st.observed_generation = generation
    st.conditions = conditions.put(st.conditions, PROGRESSING, False, reason, message[:1024], generation, now)
    settle(st, generation, now)
    return st, conditions.transitions(status.conditions, st.conditions)


def record_refusals(obs: Observed, plan: Plan, refusals: list[str], pods_refused: int) -> None:
    """The apiserver refused objects of the plan (4xx: invalid, admission, quota): the status says
    which and why (Progressing=False CreateRejected, a Warning event) instead of pretending."""
    st = plan.status
    st.replicas -= pods_refused
    st.updated_replicas -= pods_refused
    planned = conditions.get(st.conditions, PROGRESSING)
    message = "; ".join(dict.fromkeys(refusals))[:1024]
    st.conditions = conditions.put(st.conditions, PROGRESSING, False, CREATE_REJECTED, message,
                                   obs.generation, obs.now)
    settle(st, obs.generation, obs.now)
    dropped = planned.reason if planned is not None else ""
    changed = conditions.transitions(obs.status.conditions, st.conditions)
    plan.events = [e for e in plan.events if e.reason != dropped] + [
        e for e in changed if e.reason == CREATE_REJECTED]


def validation_text(exc: Exception) -> str:
    """A spec's validation error as one line per problem (field: message), for its status."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())[:1024]
    return str(exc)[:1024]


def _plan_hpa(obs: Observed, plan: Plan) -> None:
    spec = obs.spec
    if spec.autoscaling is not None:
        desired = hpas.hpa(md_name=obs.name, md_uid=obs.uid, namespace=obs.namespace, spec=spec.autoscaling)
        if hpas.needs_update(obs.hpa, desired):
            plan.hpa_apply = desired
    elif obs.hpa is not None:
        plan.hpa_delete = True
