"""The ModelDeployment's `engine`: which engine, its version, image, arguments and resources
(part of `api`, re-exported there)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from ember import contract
from ember.engines.vllm.versions import SUPPORTED_MINOR
from ember.serving.options import pod_owned_flags
from ember_operator.api_base import MAX_ARG, NO_SPACE, ApiModel, cel

ENGINE_VERSION = r"^[A-Za-z0-9][A-Za-z0-9.+_-]*$"  # PEP 440 / semver, local versions included


class EngineKind(StrEnum):
    transformers = "transformers"
    vllm = "vllm"


_RESOURCE_NAMES = "['cpu', 'memory', 'ephemeral-storage']"
_QUANTITIES = cel(
    (f"self.all(k, k in {_RESOURCE_NAMES})", "resources: only cpu, memory and ephemeral-storage"),
    ("self.all(k, isQuantity(self[k]))", "resources: values must be quantities (e.g. 4, 500m, 16Gi)"),
)
ResourceMap = dict[Annotated[str, Field(max_length=32)], Annotated[str, Field(max_length=64)]]


class EngineResources(ApiModel):
    """Requests and limits of the engine container (GPUs come from gpu.count). A CPU or memory
    utilization HPA target is a percentage of these requests."""

    requests: ResourceMap = Field(
        default_factory=lambda: {"cpu": "2", "memory": "16Gi"}, max_length=3,
        description="Requests (cpu, memory, ephemeral-storage).", json_schema_extra=_QUANTITIES,
    )
    limits: ResourceMap = Field(
        default_factory=dict, max_length=3,
        description="Limits; memory defaults to the memory request (no CPU limit: throttling a "
        "serving engine costs latency).", json_schema_extra=_QUANTITIES,
    )

    def resolved_limits(self) -> dict[str, str]:
        """Limits with the memory limit defaulted to the memory request."""
        limits = dict(self.limits)
        if "memory" in self.requests:
            limits.setdefault("memory", self.requests["memory"])
        return limits


# vLLM versions ember restores (ember.engines.vllm.versions): another would capture on every start
_VLLM_VERSION = "^(" + "|".join(m.replace(".", "[.]") for m in SUPPORTED_MINOR) + ")([.+]|$)"
# `ember serve` options a transformers pod's command owns (ember.serving.options.POD_OWNED). CEL
# refuses them at once; the operator's own check (ModelDeploymentSpec) parses engine.args as
# `ember serve` does and refuses unknown options and bad values too.
POD_FLAGS = sorted(pod_owned_flags())
TRANSFORMERS_POD_FLAGS = (
    f"engine.args: {', '.join(POD_FLAGS)} are ember's in a transformers pod (it runs `ember serve "
    f"--run-dir {contract.RUN_DIR} --host 0.0.0.0 --port {contract.ENGINE_PORT} <model> <engine.args>` "
    "under libember, behind the sidecar's hand-off)"
)
_ENGINE_RULES = cel(
    (
        f"self.kind != 'vllm' || self.version.matches('{_VLLM_VERSION}')",
        f"engine.version: ember restores vLLM {', '.join(m + '.x' for m in SUPPORTED_MINOR)} only (the "
        "adapter patches their internals); another version would capture natively on every start",
    ),
    (
        f"self.kind != 'transformers' || !has(self.args) || "
        f"self.args.all(a, !a.matches('^({'|'.join(POD_FLAGS)})(=|$)'))",
        TRANSFORMERS_POD_FLAGS,
    ),
)


class EngineSpec(ApiModel):
    """The serving engine that runs in the pod's main container and in the SAVE Job."""

    model_config = ConfigDict(json_schema_extra=_ENGINE_RULES)
    kind: EngineKind = Field(description="Engine family: transformers or vllm.")
    version: str = Field(
        description="Engine version (e.g. 0.26.0, 0.26.1rc1+cu128); part of the archive identity. "
        "Letters, digits and .+_-, starting with a letter or digit; vLLM: a version ember restores.",
        min_length=1, max_length=64, pattern=ENGINE_VERSION,
    )
    image: str = Field(
        description="Engine container image with ember installed (serves, and runs `ember save --job`). "
        "Pinned by digest (repo@sha256:…), the digest is part of the archive identity.",
        min_length=1, max_length=512, pattern=NO_SPACE,
    )
    args: list[Annotated[str, Field(max_length=MAX_ARG)]] = Field(
        default_factory=list, max_length=64,
        description="Extra engine arguments, delivered with the claim (annotation ember.dev/engine-args). "
        "Part of the archive identity, except arguments known not to change graphs (front end, "
        "logging, names, tokenizer: ember.identity_args.NOT_GRAPH_ARGS). transformers: `ember serve` "
        "options (--model or --model-config instead of model.name, --layers, --num-blocks, …), in "
        "the pods' command and the SAVE Job; what the command sets (--host, --port, --run-dir …) "
        "and what `ember serve` would refuse are refused.",
    )
    resources: EngineResources = Field(
        default_factory=EngineResources, description="CPU and memory of the engine container.",
    )


