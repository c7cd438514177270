"""The admin's sizing caps (operator settings), applied to a spec before it is planned.

Replicas (per deployment, and what the namespace's cap leaves for it) and warm GPUs above the caps
run at the caps, with a Warning each; a shape wider than `max_gpus_per_pod` is refused (phase
Invalid). The schema caps what is static (replicas ≤ 10000, warmPool.size ≤ 256, 64 GPUs a pod).
"""

from __future__ import annotations

from dataclasses import dataclass
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


def apply_limits(spec: ModelDeploymentSpec, limits: Limits, replicas_left: int | None = None,
                 ) -> tuple[ModelDeploymentSpec, list[Event]]:
    """The spec as the operator acts on it: replicas and warm GPUs capped (Warnings say so); a shape
    wider than max_gpus_per_pod raises `Refused`. `replicas_left`: what the namespace's cap
    leaves for this deployment."""
    widest = max(s.gpus for s in spec.parallelism.shapes())
    if limits.max_gpus_per_pod and widest > limits.max_gpus_per_pod:
        raise Refused(GPUS_ABOVE_LIMIT, f"a replica of {widest} GPUs is above the operator's limit of "
                          f"{limits.max_gpus_per_pod} GPUs per pod (setting max_gpus_per_pod)")
    events: list[Event] = []
    update: dict[str, Any] = {}
    caps = [(limits.max_replicas, "max_replicas")] if limits.max_replicas else []
    caps += [(replicas_left, "max_namespace_replicas")] if replicas_left is not None else []
    replicas = spec.replicas
    for cap, setting in caps:
        if replicas > cap:
            replicas = cap
            events.append(Event("Warning", "ReplicasCapped", f"replicas {spec.replicas} is above the "
                                f"operator's limit: running {cap} (setting {setting})"))
    if replicas != spec.replicas:
        update["replicas"] = replicas
    if limits.max_warm_gpus and spec.warm_pool.size > limits.max_warm_gpus:
        update["warm_pool"] = spec.warm_pool.model_copy(update={"size": limits.max_warm_gpus})
        events.append(Event("Warning", "WarmPoolCapped", f"warmPool.size {spec.warm_pool.size} is above "
                            f"the operator's limit: keeping {limits.max_warm_gpus} warm GPUs (setting "
                            "max_warm_gpus)"))
    return (spec.model_copy(update=update) if update else spec), events


def replicas_left(mds: list[dict[str, Any]], meta: dict[str, Any], cap: int, limits: Limits) -> int:
    """What the namespace's replica cap leaves for the deployment of `meta` once the older ones
    (creation time, then name) have theirs, each at most max_replicas."""
    mine = (meta.get("creationTimestamp") or "", meta.get("name") or "")
    used = 0
    for other in mds:
        om = other.get("metadata") or {}
        older = (om.get("creationTimestamp") or "", om.get("name") or "") < mine
        if older and not om.get("deletionTimestamp"):
            want = int((other.get("spec") or {}).get("replicas") or 0)
            used += min(want, limits.max_replicas) if limits.max_replicas else want
    return max(0, cap - used)
