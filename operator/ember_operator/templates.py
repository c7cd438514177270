"""Merging a ModelDeployment's `spec.template` (`api_template.PodTemplatePatch`) into the pods ember
builds (pure; `pods.py` and `jobs.py` call it).

Strategic-merge style, with ember's side winning where admission has not already refused a
collision: labels, annotations and the node selector are added under ember's keys; volumes,
tolerations, imagePullSecrets, envFrom and mounts are appended; env merges by name (a variable
replaces one of ember's defaults, HOME or XDG_CACHE_HOME); resources merge over the engine's
(GPUs stay ember's); serviceAccountName, priorityClassName and affinity are set.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.utils import parse_quantity

from ember import contract
from ember_operator.api_template import PodTemplatePatch


def encode(patch: PodTemplatePatch | None) -> str:
    """The patch as canonical JSON ("" when there is none): part of a pool's key."""
    if patch is None:
        return ""
    wire = patch.wire()
    return json.dumps(wire, sort_keys=True, separators=(",", ":")) if _non_empty(wire) else ""


def _non_empty(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_non_empty(v) for v in node.values())
    if isinstance(node, list):
        return bool(node)
    return node is not None


def decode(text: str) -> PodTemplatePatch | None:
    return PodTemplatePatch.model_validate_json(text) if text else None


def merge_env(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ember's variables, each replaced by theirs of the same name, then their others."""
    by_name = {e["name"]: e for e in theirs}
    return [by_name.pop(e["name"], e) for e in ours] + list(by_name.values())


def _resources(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Their requests and limits over ours; the GPU count stays ours. The memory limit (which
    defaults to the memory request) is raised to a larger memory request of theirs."""
    out = {}
    for kind in ("requests", "limits"):
        mine = ours.get(kind) or {}
        gpus = {k: v for k, v in mine.items() if k == contract.GPU_RESOURCE}
        if merged := {**mine, **(theirs.get(kind) or {}), **gpus}:
            out[kind] = merged
    request, limit = (out.get(k, {}).get("memory") for k in ("requests", "limits"))
    if (
        request
        and limit
        and "memory" not in (theirs.get("limits") or {})
        and (parse_quantity(request) > parse_quantity(limit))
    ):
        out["limits"]["memory"] = request
    return out


def apply_container(container: dict[str, Any], patch: PodTemplatePatch | None) -> dict[str, Any]:
    """The engine (or SAVE) container with the template's env, envFrom, mounts and resources."""
    engine = patch.engine() if patch is not None else None
    if engine is None:
        return container
    out, wire = dict(container), engine.wire()
    if wire.get("env"):
        out["env"] = merge_env(container.get("env") or [], wire["env"])
    for key in ("envFrom", "volumeMounts"):
        if wire.get(key):
            out[key] = [*(container.get(key) or []), *wire[key]]
    if wire.get("resources"):
        out["resources"] = _resources(container.get("resources") or {}, wire["resources"])
    return out


def apply_metadata(meta: dict[str, Any], patch: PodTemplatePatch | None) -> dict[str, Any]:
    """Labels and annotations added under ember's."""
    if patch is None:
        return meta
    out = dict(meta)
    for key in ("labels", "annotations"):
        theirs = getattr(patch.metadata, key)
        if theirs:
            out[key] = {**theirs, **(meta.get(key) or {})}
    return out


def apply_spec(spec: dict[str, Any], patch: PodTemplatePatch | None) -> dict[str, Any]:
    """Pod-level fields; the container named `contract.ENGINE_CONTAINER` or `SAVE_CONTAINER` gets
    the engine part (`apply_container`)."""
    if patch is None:
        return spec
    out = dict(spec)
    wire = patch.spec.wire()
    for key in ("volumes", "tolerations", "imagePullSecrets"):
        if wire.get(key):
            out[key] = [*(spec.get(key) or []), *wire[key]]
    if wire.get("nodeSelector"):
        out["nodeSelector"] = {**wire["nodeSelector"], **(spec.get("nodeSelector") or {})}
    for key in ("serviceAccountName", "priorityClassName", "affinity"):
        if wire.get(key) is not None:
            out[key] = wire[key]
    engines = (contract.ENGINE_CONTAINER, contract.SAVE_CONTAINER)
    out["containers"] = [
        apply_container(c, patch) if c["name"] in engines else c for c in spec.get("containers") or []
    ]
    return out
