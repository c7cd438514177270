"""Builders shared by the operator's unit tests (no cluster)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from ember_operator.api import ModelDeploymentSpec, ModelDeploymentStatus
from ember_operator.planning import Context, Observed

NOW = datetime(2026, 11, 22, 2, 0, 0, tzinfo=UTC)
CTX = Context(sidecar_image="ember:test", default_store="file:///var/lib/ember",
              store_endpoints=("http://127.0.0.1",))


def md_spec(**over: Any) -> ModelDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen3-0.6B"},
        "engine": {"kind": "transformers", "version": "4.57.0", "image": "engine:test"},
        "capture": {"sizes": [1, 2, 4, 8], "maxBatch": 8, "maxNumTokens": 2048},
        "gpu": {"product": "NVIDIA-H100-80GB-HBM3"},
        "replicas": 2,
        "store": {"s3": {"bucket": "ember", "endpoint": "http://127.0.0.1:19000", "credentialsSecret": "s3"}},
    }
    for key, value in over.items():
        raw[key] = value
    return ModelDeploymentSpec.model_validate(raw)


def observed(spec: ModelDeploymentSpec | None = None, **over: Any) -> Observed:
    fields: dict[str, Any] = {
        "name": "qwen", "namespace": "default", "uid": "uid-1", "generation": 1,
        "spec": spec or md_spec(), "status": ModelDeploymentStatus(), "now": NOW,
    }
    fields.update(over)
    return Observed(**fields)


@pytest.fixture
def ctx() -> Context:
    return CTX
