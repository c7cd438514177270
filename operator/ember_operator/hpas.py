"""Pure builder of the autoscaling/v2 HorizontalPodAutoscaler for a ModelDeployment's /scale.

Targets: Resource (cpu/memory utilization of the engine's requests, `engine.resources`), Pods (a
per-pod custom metric served by a metrics adapter, e.g. the engine's requests waiting) or External
(a metric not attached to the pods, e.g. a queue depth; selector → matchLabels).
"""

from __future__ import annotations

from typing import Any

from ember import contract
from ember_operator import naming
from ember_operator.api import AutoscalingSpec, MetricTarget
from ember_operator.pods import owner_reference


def _metric(t: MetricTarget) -> dict[str, Any]:
    target: dict[str, Any]
    if t.average_utilization is not None:
        target = {"type": "Utilization", "averageUtilization": t.average_utilization}
    else:
        target = {"type": "AverageValue", "averageValue": t.average_value}
    if t.type == "Resource":
        return {"type": "Resource", "resource": {"name": t.name, "target": target}}
    metric: dict[str, Any] = {"name": t.name}
    if t.type == "External":
        if t.selector:
            metric["selector"] = {"matchLabels": dict(t.selector)}
        return {"type": "External", "external": {"metric": metric, "target": target}}
    return {"type": "Pods", "pods": {"metric": metric, "target": target}}


def hpa(*, md_name: str, md_uid: str, namespace: str, spec: AutoscalingSpec) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": naming.hpa_name(md_name),
            "namespace": namespace,
            "labels": {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR,
                       contract.LABEL_DEPLOYMENT: md_name},
            "ownerReferences": [owner_reference(md_name, md_uid)],
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT,
                               "name": md_name},
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [_metric(t) for t in spec.targets],
        },
    }


def needs_update(observed: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    if observed is None:
        return True
    spec = observed.get("spec") or {}
    want = desired["spec"]
    if any(spec.get(k) != want[k] for k in ("scaleTargetRef", "minReplicas", "maxReplicas")):
        return True
    # No targets: the apiserver defaults the metrics (CPU 80 %); accept whatever it stored.
    return bool(want["metrics"]) and (spec.get("metrics") or []) != want["metrics"]
