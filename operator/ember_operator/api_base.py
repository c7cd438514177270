"""Building blocks of the `ember.dev/v1alpha1` models (ember_operator/api.py re-exports them): the
wire base model, CEL rule extras, and the name and size limits the apiserver would enforce later."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# ------------------------------------------------------------------------------------------------
# Helpers


def cel(*rules: tuple[str, str], **extra: Any) -> dict[str, Any]:
    """JSON-schema extras carrying CEL rules: each rule is (expression, message)."""
    out: dict[str, Any] = dict(extra)
    out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return out


class ApiModel(BaseModel):
    """Wire models: camelCase aliases, unknown fields refused (the apiserver prunes them anyway)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


MAX_NAME = 40  # ModelDeployment names prefix pod, HPA and label values (63-char limits)

# Names the apiserver would refuse later, on the pod or Job the operator builds: refused here.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
NO_SPACE = r"^\S+$"  # an image reference: no whitespace anywhere (a leading space breaks pulls)
# A label/annotation key: optional DNS-subdomain prefix and '/', then a name of ≤ 63 characters.
_QUALIFIED_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# Claims and pod templates carry args, compile settings and pod annotations as annotations, whose
# total the apiserver caps at 256 KiB: each is bounded so that the sum stays far below.
MAX_ARG = 1024
MAX_MAP_ENTRIES = 32
MAX_MAP_VALUE = 1024
MapValue = Annotated[str, Field(max_length=MAX_MAP_VALUE)]
LabelValue = Annotated[str, Field(max_length=63)]
KEYS_RULE = (f"self.all(k, k.matches('{_QUALIFIED_KEY}'))",
             "annotation keys must be valid label keys ([prefix/]name, name at most 63 characters)")
