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
4. Old-revision pods are deleted as current-revision pods become ready (a rolling move).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ember.identity import canonical_json
from ember_operator import API_VERSION, conditions, hpas, naming
from ember_operator.api import (
    ArchiveRef,
    GraphArchiveSpec,
    IdentitySpec,
    MDPhase,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    SaveSpec,
    StoreSpec,
)
from ember_operator.conditions import Event
from ember_operator.pods import Claim, PodTemplate, StoreAccess, claim_patch, serving_pod
from ember_operator.views import ArchiveView, PodView

ARCHIVE_READY = "ArchiveReady"
AVAILABLE = "Available"
PROGRESSING = "Progressing"


@dataclass(frozen=True)
class Context:
    """Operator-wide inputs of planning (from Settings)."""

    sidecar_image: str
    default_store: str = ""
    default_s3_endpoint: str = ""
    pod_service_account: str = ""


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
    hpa: dict[str, Any] | None = None
    labels: dict[str, str] = field(default_factory=dict)


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
    labels: dict[str, str] = field(default_factory=dict)  # labels to set on the ModelDeployment
    claim: Claim | None = None  # what claims and new pods carry (replacements of lost claims too)


def store_of(spec: ModelDeploymentSpec, ctx: Context) -> StoreSpec:
    if spec.store is not None:
        return spec.store
    if not ctx.default_store:
        raise ValueError(
            "spec.store is unset and the operator has no default store (EMBER_OPERATOR_DEFAULT_STORE)"
        )
    return StoreSpec.from_uri(ctx.default_store, ctx.default_s3_endpoint)


def template_of(namespace: str, spec: ModelDeploymentSpec, ctx: Context) -> PodTemplate:
    return PodTemplate(
        namespace=namespace,
        gpu_product=spec.gpu.product,
        gpu_count=spec.gpu.count,
        engine_kind=spec.engine.kind.value,
        engine_version=spec.engine.version,
        engine_image=spec.engine.image,
        sidecar_image=ctx.sidecar_image,
        store=StoreAccess.of(store_of(spec, ctx)),
        service_account=ctx.pod_service_account,
    )


def revision_of(identity_hash: str, template: PodTemplate, spec: ModelDeploymentSpec) -> str:
    """Pods of another revision are rolled: identity, pool template or engine args changed."""
    return naming.short_hash(identity_hash, template.pool_key, list(spec.engine.args), length=10)


def archive_object(name: str, namespace: str, spec: ModelDeploymentSpec, ctx: Context) -> dict[str, Any]:
    ident = spec.identity()
    ga = GraphArchiveSpec(
        identity_hash=ident.hash(),
        identity=IdentitySpec.of(ident),
        store=store_of(spec, ctx),
        save=SaveSpec(
            image=spec.engine.image, args=list(spec.engine.args),
            pod_annotations=dict(spec.save.pod_annotations), timeout_seconds=spec.save.timeout_seconds,
        ),
    )
    return {
        "apiVersion": API_VERSION,
        "kind": "GraphArchive",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                naming.MANAGED_BY: naming.OPERATOR_NAME,
                naming.IDENTITY: ident.short(),
                naming.GPU_PRODUCT: spec.gpu.product,
            },
        },
        "spec": ga.wire(),
    }


def _deletion_order(pods: list[PodView]) -> list[PodView]:
    """Which pods go first when scaling down: not ready, fallen back, then newest."""
    return sorted(pods, key=lambda p: (p.ready, not p.fell_back, p.created, p.name), reverse=False)


def free_names(md_name: str, revision: str, taken: set[str], count: int) -> list[str]:
    names, i = [], 0
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
        store_reasons = ("CredentialsSecretMissing", "StoreUnreachable")
        reason = archive.reason if archive.reason in store_reasons else "SaveFailed"
        retry = f"; retrying at {archive.next_retry_time}" if archive.next_retry_time else ""
        return False, reason, f"{archive.message or archive.phase}; serving with native capture{retry}"
    if archive.phase == "Saving":
        return False, "Saving", f"SAVE Job running for {archive.name}"
    return False, "ArchivePending", f"{archive.name} is {archive.phase}"


def plan_deployment(obs: Observed, ctx: Context) -> Plan:
    spec = obs.spec
    ident = spec.identity()
    ident_hash = ident.hash()
    ga_name = naming.archive_name(ident_hash)
    template = template_of(obs.namespace, spec, ctx)
    revision = revision_of(ident_hash, template, spec)
    plan = Plan(status=obs.status.model_copy(deep=True))
    now = obs.now
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # fractional: the sidecar times from it

    if obs.labels.get(naming.IDENTITY) != ident.short():
        plan.labels[naming.IDENTITY] = ident.short()
    archive = obs.archive
    if archive is None:
        plan.archive_create = archive_object(ga_name, obs.namespace, spec, ctx)

    arch_status, arch_reason, arch_message = _archive_condition(archive)
    archive_uri = archive.uri if archive is not None and archive.available else ""

    live = [p for p in obs.pods if not p.deleting]
    current = [p for p in live if p.revision == revision]
    # Deploy when pods can restore (Available) or must capture natively (failing). A retried SAVE
    # does not stop a deployment that already serves natively from scaling.
    can_deploy = archive is not None and (archive.available or archive.failing or bool(current))
    old = [p for p in live if p.revision != revision]
    # Pods that exited (Failed/Succeeded) never come back: replace them.
    dead = [p for p in current if p.failed]
    plan.deletes += [p.name for p in dead]
    current = [p for p in current if not p.failed]
    want = spec.replicas

    claim = Claim(
        deployment=obs.name, deployment_uid=obs.uid, identity_hash=ident_hash,
        identity_json=canonical_json(ident.canonical()).decode(), revision=revision,
        archive_uri=archive_uri, engine_args=tuple(spec.engine.args), claimed_at=stamp,
        native_reason="" if archive_uri else arch_reason,
    )
    plan.claim = claim
    claimed = claimed_ready = 0
    if can_deploy:
        missing = want - len(current)
        if missing > 0:
            warm = sorted((p for p in obs.warm if not p.deleting and not p.failed),
                          key=lambda p: (not p.ready, p.created, p.name))
            for pod in warm[:missing]:
                plan.claims.append((pod.name, claim_patch(claim, pod.resource_version)))
            claimed = min(missing, len(warm))
            claimed_ready = sum(p.ready for p in warm[:missing])
            taken = {p.name for p in obs.pods}
            for name in free_names(obs.name, revision, taken, missing - claimed):
                plan.creates.append(serving_pod(template, claim, name))
        elif missing < 0:
            plan.deletes += [p.name for p in _deletion_order(current)[: -missing]]
        ready_current = sum(p.ready for p in current)
        keep_old = max(0, want - ready_current)
        plan.deletes += [p.name for p in _deletion_order(old)[: max(0, len(old) - keep_old)]]
    else:
        # Waiting for the archive: keep what serves, but never more than asked for.
        serving = _deletion_order(old + current)
        plan.deletes += [p.name for p in serving[: max(0, len(serving) - want)]]

    # ---- status
    deleted = set(plan.deletes)
    remaining = [p for p in live if p.name not in deleted]
    st = plan.status
    st.observed_generation = obs.generation
    st.selector = naming.selector(obs.name)
    st.revision = revision
    st.replicas = len(remaining) + len(plan.creates) + claimed
    st.ready_replicas = sum(p.ready for p in remaining) + claimed_ready
    st.updated_replicas = sum(p.revision == revision for p in remaining) + len(plan.creates) + claimed
    st.restored_replicas = sum(p.restored for p in remaining)
    st.fallback_count = sum(p.fell_back for p in remaining)
    st.warm_claims += claimed
    times = [t for p in remaining if p.restored
             and (t := p.annotations.get(naming.RESTORE_TIME) or p.annotations.get(naming.CLAIMED_AT))]
    if times:
        st.last_restore_time = max(times)
    st.archive = ArchiveRef(
        name=ga_name, identity_hash=ident_hash, uri=archive_uri or None,
        phase=archive.phase if archive is not None else "Pending",
    )

    conds = list(st.conditions)
    gen = obs.generation
    conds = conditions.put(conds, ARCHIVE_READY, arch_status, arch_reason, arch_message, gen, now)

    ready_current = sum(p.ready for p in remaining if p.revision == revision) + claimed_ready
    old_left = sum(p.revision != revision for p in remaining)
    if want == 0:
        avail = (True, "ScaledToZero", "replicas is 0")
    elif st.ready_replicas == 0 and not can_deploy:
        avail = (False, "WaitingForArchive", f"0/{want} replicas ready; waiting for the archive")
    elif st.ready_replicas == 0:
        avail = (False, "ReplicasNotReady", f"0/{want} replicas ready")
    elif st.fallback_count or (archive is not None and archive.failing):
        n = st.fallback_count
        why = f"{n} pod(s) fell back to native capture" if n else "archive unavailable"
        avail = (True, "NativeCapture" if not n or n >= st.ready_replicas else "PartialFallback",
                 f"{st.ready_replicas}/{want} replicas ready; {why}")
    else:
        avail = (True, "ReplicasReady", f"{st.ready_replicas}/{want} replicas ready")
    conds = conditions.put(conds, AVAILABLE, *avail, gen, now)

    if archive is None or (not can_deploy and archive.phase == "Pending" and not old_left and not current):
        prog = (True, MDPhase.pending.value, "waiting for the GraphArchive")
    elif not can_deploy and old_left:
        prog = (True, MDPhase.reconfiguring.value,
                f"new identity {ident.short()}: SAVE running; "
                f"{old_left} pod(s) keep serving the previous one")
    elif not can_deploy:
        prog = (True, MDPhase.saving.value, f"waiting for the SAVE of {ga_name}")
    elif old_left:
        prog = (True, MDPhase.reconfiguring.value,
                f"moving pods to revision {revision}: {ready_current}/{want} ready, {old_left} old left")
    elif ready_current < want or st.updated_replicas != want or st.replicas != want:
        if ready_current == 0 and not any(p.ready for p in obs.pods):
            prog = (True, MDPhase.deploying.value, f"{ready_current}/{want} replicas ready")
        else:
            prog = (True, MDPhase.scaling.value, f"{ready_current}/{want} replicas ready")
    else:
        prog = (False, "Complete", f"{want} replica(s) of revision {revision} ready")
    conds = conditions.put(conds, PROGRESSING, *prog, gen, now)
    st.conditions = sorted(conds, key=lambda c: [ARCHIVE_READY, AVAILABLE, PROGRESSING].index(c.type)
                           if c.type in (ARCHIVE_READY, AVAILABLE, PROGRESSING) else 9)
    old_phase = obs.status.phase
    st.phase = derive_phase(st.conditions)
    plan.events = conditions.transitions(obs.status.conditions, st.conditions)
    # In-progress phases are the Progressing reason (already an event); settled ones get their own.
    if old_phase != st.phase and st.phase in (MDPhase.ready, MDPhase.degraded):
        plan.events.append(Event("Normal" if st.phase is MDPhase.ready else "Warning", "Phase",
                                 f"phase {old_phase.value if old_phase else 'None'} → {st.phase.value}"))
    if claimed:
        plan.events.append(Event("Normal", "Claimed", f"claimed {claimed} warm pod(s)"))

    # ---- HPA
    if spec.autoscaling is not None:
        desired = hpas.hpa(md_name=obs.name, md_uid=obs.uid, namespace=obs.namespace, spec=spec.autoscaling)
        if hpas.needs_update(obs.hpa, desired):
            plan.hpa_apply = desired
    elif obs.hpa is not None:
        plan.hpa_delete = True
    return plan


def derive_phase(conds: list[Any]) -> MDPhase:
    """The phase is a summary of the conditions (never stored state of its own)."""
    prog = conditions.get(conds, PROGRESSING)
    avail = conditions.get(conds, AVAILABLE)
    if prog is not None and prog.status.value == "True":
        try:
            return MDPhase(prog.reason)
        except ValueError:
            return MDPhase.deploying
    if avail is not None and avail.reason in ("NativeCapture", "PartialFallback"):
        return MDPhase.degraded
    if avail is not None and avail.status.value != "True":
        return MDPhase.degraded
    return MDPhase.ready
