"""Pure planning of parallelism switches: archives saved ahead for the alternatives, the drain of
old pods, and the switch's status and events. `planning.plan_deployment` calls these.

A switch is an edit of `spec.parallelism` (tensor/expert/data): the revision changes, so the pod
plan starts new-shape pods (claimed from the warm pool of their GPU count first) and keeps every
old pod in service until as many new ones are Ready as `replicas` asks (capacity never drops
below the old shape's). Old pods then *drain*: label `ember.dev/pool=draining` (out of the
Service, the HPA's count and status.selector) and annotation `ember.dev/drain-at` (the sidecar's
readiness turns off); `spec.drainSeconds` later they are deleted. An edit back mid-switch puts
draining pods of the wanted revision back in service instead of starting new ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from ember import contract
from ember.contract import Claim
from ember_operator import naming
from ember_operator.api import ShapeSpec, ShapeStatus, SwitchStatus
from ember_operator.conditions import Event, parse_time
from ember_operator.observed import ArchiveView, PodView

if TYPE_CHECKING:
    from ember_operator.planning import Observed, Plan


def uses_label(identity_short: str) -> str:
    """The ModelDeployment label naming an identity it uses (current or alternative shape), so the
    archive of an alternative has a user (and is not garbage-collected) before any pod runs it."""
    return f"{contract.GROUP}/uses-{identity_short}"


def drain_patch(now: datetime) -> dict[str, object]:
    return {"metadata": {"labels": {contract.LABEL_POOL: contract.POOL_DRAINING},
                         "annotations": {contract.ANN_DRAIN: contract.format_claimed_at(now.timestamp())}}}


def undrain_patch() -> dict[str, object]:
    return {"metadata": {"labels": {contract.LABEL_POOL: contract.POOL_SERVING},
                         "annotations": {contract.ANN_DRAIN: None}}}


def shapes_and_labels(
    obs: Observed, plan: Plan, current_archive: ArchiveView | None,
) -> list[tuple[ShapeSpec, str]]:
    """status.shapes, and the MD's `uses-` labels (stale ones removed). Returns the alternatives
    whose GraphArchive does not exist yet, with that archive's name (the caller creates them, at
    presave priority)."""
    spec, missing, shapes = obs.spec, [], []
    wanted_labels = set()
    current, named = spec.identity().hash(), set()  # shapes may share an archive (vLLM's dense DP)
    for i, shape in enumerate(spec.parallelism.shapes()):
        ident = spec.identity(shape)
        archive = naming.archive_name(ident.hash())
        view = current_archive if ident.hash() == current else obs.alt_archives.get(ident.hash())
        if ident.hash() != current and view is None and archive not in named:
            missing.append((shape, archive))
        named.add(archive)
        wanted_labels.add(uses_label(ident.short()))
        shapes.append(ShapeStatus(
            tensor=shape.tensor, expert=shape.expert, data=shape.data, gpus=shape.gpus, current=i == 0,
            archive=archive, phase=view.phase if view else "Pending",
            uri=view.uri if view is not None and view.available else None,
        ))
    plan.status.shapes = shapes
    prefix = uses_label("")
    for key in obs.labels:
        if key.startswith(prefix) and key not in wanted_labels:
            plan.labels[key] = None
    for key in wanted_labels - set(obs.labels):
        plan.labels[key] = "true"
    return missing


def undrain(
    obs: Observed, plan: Plan, claim: Claim, count: int, is_current: Callable[[PodView, Claim], bool],
) -> list[PodView]:
    """Draining pods of the wanted revision put back in service (up to `count`), newest drain last."""
    if count <= 0:
        return []
    fits = [p for p in obs.draining if not p.deleting and not p.failed and is_current(p, claim)]
    back = sorted(fits, key=lambda p: (not p.ready, p.drain_at))[:count]
    plan.undrains += [p.name for p in back]
    return back


def expire_drains(obs: Observed, plan: Plan) -> None:
    """Draining pods whose grace period is over are deleted; the plan asks to look again when the
    next one's ends."""
    grace = obs.spec.drain_seconds
    back = set(plan.undrains)
    waits = []
    for pod in obs.draining:
        if pod.deleting or pod.name in back:
            continue
        since = parse_time(pod.drain_at)
        left = grace - ((obs.now - since).total_seconds() if since is not None else grace)
        if left <= 0 or pod.failed:
            plan.deletes.append(pod.name)
        else:
            waits.append(left)
    if waits:
        plan.requeue_after = min(waits) + 0.05


def take_out(obs: Observed, plan: Plan, pods: list[PodView]) -> None:
    """Old pods leave service: drained (deleted after drainSeconds), or deleted at once when they
    exited or the deployment drains for 0 s."""
    for pod in pods:
        if pod.failed or obs.spec.drain_seconds == 0:
            plan.deletes.append(pod.name)
        else:
            plan.drains.append(pod.name)
    if plan.drains:
        plan.requeue_after = min(plan.requeue_after or 1e9, obs.spec.drain_seconds + 0.05)


def previous_shape(obs: Observed, plan: Plan, old: list[PodView]) -> ShapeSpec | None:
    """The shape being left: the most common shape, other than the current one, among old pods in
    service and pods still draining. None when no pod of another shape is left."""
    current = obs.spec.parallelism.key()
    gone, leaving = set(plan.deletes) | set(plan.undrains), set(plan.drains)
    pods = old + [p for p in obs.pods if p.name in leaving]
    pods += [p for p in obs.draining if p.name not in gone and not p.deleting]
    counts = Counter(p.shape for p in pods if p.shape is not None and p.shape != current)
    if not counts:
        return None
    tensor, expert, data = counts.most_common(1)[0][0]
    return ShapeSpec(tensor=tensor, expert=expert, data=data)


def switch_status(
    obs: Observed, plan: Plan, previous: ShapeSpec | None, new_ready: int, old_serving: int, presaved: bool,
) -> None:
    """status.switch and the events of each step: started, new shape Ready, old pods draining,
    complete (with how long it took)."""
    old = obs.status.switch
    target = obs.spec.parallelism.shape()
    want = obs.spec.replicas
    if previous is None:
        plan.status.switch = None
        if old is not None:
            took = _since(old.started_time, obs.now)
            what = f"{old.previous.label()} → {target.label()}: {want} new-shape replica(s) serving{took}"
            plan.events.append(Event("Normal", "SwitchComplete", what))
        return
    going = old if old is not None and old.target.key() == target.key() else None  # this switch, seen before
    restarted = going is None
    started = going.started_time if going is not None else contract.format_claimed_at(obs.now.timestamp())
    draining = len({p.name for p in obs.draining} - set(plan.deletes) - set(plan.undrains)) + len(plan.drains)
    new = SwitchStatus(previous=previous, target=target, started_time=started, new_ready=new_ready,
                       replicas=want, old_serving=old_serving, draining=draining,
                       presaved=going.presaved if going is not None else presaved)
    plan.status.switch = new
    if restarted:
        how = ("its archive was saved ahead: no SAVE, no capture" if presaved
               else "its archive is not saved yet: SAVE first, the old pods keep serving")
        plan.events.append(Event("Normal", "SwitchStarted", f"{previous.label()} → {target.label()}: {how}"))
    if new_ready >= want and (going is None or going.new_ready < want):
        plan.events.append(Event("Normal", "NewShapeReady", f"{new_ready}/{want} {target.label()} replica(s) "
                                 f"Ready; {old_serving + len(plan.drains)} old pod(s) leave service"))
    if plan.drains:
        plan.events.append(Event("Normal", "Draining", f"{len(plan.drains)} {previous.label()} pod(s) out of "
                                 f"service; deleted after {obs.spec.drain_seconds}s"))


def _since(started: str, now: datetime) -> str:
    at = parse_time(started)
    return f" in {(now - at).total_seconds():.1f}s" if at is not None else ""
