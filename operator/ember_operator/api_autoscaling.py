"""Autoscaling of a ModelDeployment (`spec.autoscaling`): the HPA bounds and metric targets
(ember_operator/api.py re-exports these models)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ember_operator.api_base import ApiModel, LabelValue, cel

# A Kubernetes quantity: the operator's own check of objects stored before admission had CEL's
# isQuantity() (a non-quantity made the HPA create fail on every pass, status never written).
QUANTITY = r"^[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$"


class MetricTarget(ApiModel):
    """One HPA metric target."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "has(self.averageValue) != has(self.averageUtilization)",
                "autoscaling target: set exactly one of averageValue and averageUtilization",
            ),
            (
                "!has(self.averageUtilization) || self.type == 'Resource'",
                "autoscaling target: averageUtilization applies to Resource metrics only",
            ),
            (
                "self.type != 'Resource' || self.name in ['cpu', 'memory']",
                "autoscaling target: Resource metrics are cpu or memory (GPU use is not a resource "
                "metric the HPA can read; scale on a Pods or External metric such as requests waiting)",
            ),
            (
                "!has(self.averageValue) || isQuantity(self.averageValue)",
                "autoscaling target: averageValue must be a quantity (e.g. 8, 500m, 1Gi)",
            ),
            (
                "!has(self.selector) || self.type == 'External'",
                "autoscaling target: selector applies to External metrics only",
            ),
        )
    )
    type: Literal["Resource", "Pods", "External"] = Field(
        description="Resource (cpu, memory; needs resources.requests), Pods (a per-pod custom metric, "
        "e.g. the engine's requests waiting) or External (a metric not attached to the pods; its "
        "total is divided by the replicas: averageValue)."
    )
    name: str = Field(min_length=1, max_length=253, description="Metric or resource name.")
    selector: dict[Annotated[str, Field(max_length=316)], LabelValue] | None = Field(
        None, max_length=16, description="External metrics: matchLabels of the metric series.",
    )
    average_value: str | None = Field(
        None, max_length=64, pattern=QUANTITY,
        description="Target average value per pod (a quantity, e.g. 8 or 500m).",
    )
    average_utilization: int | None = Field(
        None, ge=1, le=1000, description="Target average utilization in percent of requests."
    )


class AutoscalingSpec(ApiModel):
    """When set, the operator keeps an autoscaling/v2 HPA pointed at this ModelDeployment's /scale."""

    model_config = ConfigDict(
        json_schema_extra=cel((
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
        ))
    )
    min_replicas: int = Field(1, ge=1, le=10000, description="Lower bound for the HPA.")
    max_replicas: int = Field(ge=1, le=10000, description="Upper bound for the HPA.")
    targets: list[MetricTarget] = Field(
        default_factory=list, max_length=8,
        description="Metric targets; none means the HPA only enforces the bounds.",
    )
