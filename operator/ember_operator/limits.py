"""The admin's sizing caps (operator settings), applied to a spec before it is planned.

Replicas and warm GPUs above the caps — per deployment, and what a namespace's cap leaves for it
(the older deployments served first, `namespace_left`) — run at the caps, with a Warning each
(`Notices` posts a Warning once per change, not on every pass); a shape wider than
`max_gpus_per_pod` is refused (phase Invalid). The schema caps what is static (replicas ≤ 10000,
warmPool.size ≤ 256, 64 GPUs a pod); the chart's admission policy refuses specs above the
per-deployment caps before they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember_operator.api import ModelDeploymentSpec
from ember_operator.conditions import Event
from ember_operator.tenancy import Refused

GPUS_ABOVE_LIMIT = "GpusPerPodAboveLimit"


@dataclass(frozen=True)
class Limits:
    """The admin's sizing caps (operator settings; 0: none)."""

    max_replicas: int = 0
    max_warm_gpus: int = 0
    max_gpus_per_pod: int = 0
    max_namespace_replicas: int = 0
    max_namespace_warm_gpus: int = 0


@dataclass(frozen=True)
class Left:
    """What the namespace's caps leave for one deployment (None: no such cap)."""

    replicas: int | None = None
    warm_gpus: int | None = None


def _capped(value: int, caps: list[tuple[int | None, str]], what: str, unit: str) -> tuple[int, list[str]]:
    """`value` under each (cap, setting) that is set, and a message per cap that trims it."""
    asked, notes = value, []
    for cap, setting in caps:
        if cap is not None and value > cap:
            notes.append(f"{what} {asked} is above the operator's limit: {unit.format(cap)} "
                         f"(setting {setting})")
            value = cap
    return value, notes


def apply_limits(spec: ModelDeploymentSpec, limits: Limits, left: Left | None = None,
                 ) -> tuple[ModelDeploymentSpec, list[Event]]:
    """The spec as the operator acts on it: replicas and warm GPUs capped (Warnings say so); a shape
    wider than max_gpus_per_pod raises `Refused`. `left`: what the namespace's caps leave for this
    deployment (`namespace_left`)."""
    widest = max(s.gpus for s in spec.parallelism.shapes())
    if limits.max_gpus_per_pod and widest > limits.max_gpus_per_pod:
        raise Refused(GPUS_ABOVE_LIMIT, f"a replica of {widest} GPUs is above the operator's limit of "
                          f"{limits.max_gpus_per_pod} GPUs per pod (setting max_gpus_per_pod)")
    left = left or Left()
    replicas, replica_notes = _capped(spec.replicas, [
        (limits.max_replicas or None, "max_replicas"), (left.replicas, "max_namespace_replicas"),
    ], "replicas", "running {}")
    warm, warm_notes = _capped(spec.warm_pool.size, [
        (limits.max_warm_gpus or None, "max_warm_gpus"), (left.warm_gpus, "max_namespace_warm_gpus"),
    ], "warmPool.size", "keeping {} warm GPUs")
    events = [Event("Warning", "ReplicasCapped", n) for n in replica_notes]
    events += [Event("Warning", "WarmPoolCapped", n) for n in warm_notes]
    update: dict[str, Any] = {}
    if replicas != spec.replicas:
        update["replicas"] = replicas
    if warm != spec.warm_pool.size:
        update["warm_pool"] = spec.warm_pool.model_copy(update={"size": warm})
    return (spec.model_copy(update=update) if update else spec), events


def namespace_left(mds: list[dict[str, Any]], meta: dict[str, Any], limits: Limits) -> Left:
    """What the namespace's caps leave for the deployment of `meta` once the older ones (creation
    time, then name) have theirs, each at most its per-deployment cap. Warm GPUs count per
    deployment (deployments sharing a pool count it each: the cap errs on the safe side)."""
    if not (limits.max_namespace_replicas or limits.max_namespace_warm_gpus):
        return Left()
    mine = (meta.get("creationTimestamp") or "", meta.get("name") or "")
    replicas = warm = 0
    for other in mds:
        om = other.get("metadata") or {}
        if (om.get("creationTimestamp") or "", om.get("name") or "") >= mine or om.get("deletionTimestamp"):
            continue
        spec = other.get("spec") or {}
        want = int(spec.get("replicas") or 0)
        replicas += min(want, limits.max_replicas) if limits.max_replicas else want
        size = int((spec.get("warmPool") or {}).get("size") or 0)
        warm += min(size, limits.max_warm_gpus) if limits.max_warm_gpus else size
    return Left(
        replicas=max(0, limits.max_namespace_replicas - replicas) if limits.max_namespace_replicas else None,
        warm_gpus=max(0, limits.max_namespace_warm_gpus - warm) if limits.max_namespace_warm_gpus else None,
    )


@dataclass
class Notices:
    """Warnings about caps, posted when they change for a deployment (a cap may start to trim it
    because another deployment grew: no spec change of its own), not on every pass."""

    said: dict[tuple[str, str], tuple[Event, ...]] = field(default_factory=dict)

    def fresh(self, key: tuple[str, str], events: list[Event]) -> list[Event]:
        if self.said.get(key, ()) == tuple(events):
            return []
        self.said[key] = tuple(events)
        return events
