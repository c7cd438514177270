"""The Service of a ModelDeployment: named after it, selecting its Ready serving pods.

One Service per deployment (`<name>.<namespace>.svc`), port `http` → the engine container's
`contract.ENGINE_PORT` (vLLM's and `ember serve`'s 8000). Its selector is the deployment's
serving pods (`ember.dev/deployment=<name>,ember.dev/pool=serving`): warm pods (`pool=warm`, no
deployment label), SAVE pods (no pool label) and draining pods (`pool=draining`) are never in it,
and the endpoints controller lists only pods whose readiness (the sidecar's `/readyz`: restored or
captured, engine serving) is True. Owned by the deployment (deleted with it by the garbage
collector). `apply_service` creates it or puts its selector and ports back; a Service of that name
that another owner holds is left alone and reported.
"""

from __future__ import annotations

from typing import Any

from ember import contract
from ember_operator.api import ModelDeploymentStatus
from ember_operator.kube import Kube, KubeError, merge_patch
from ember_operator.pods import owner_reference

PORT_NAME = "http"


def services_path(ns: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{ns}/services"
    return f"{base}/{name}" if name else base


def address(name: str, namespace: str) -> str:
    """What status.address shows: the in-cluster DNS name and port."""
    return f"{name}.{namespace}.svc:{contract.ENGINE_PORT}"


def service_spec(name: str) -> dict[str, Any]:
    return {
        "type": "ClusterIP",
        "selector": {contract.LABEL_DEPLOYMENT: name, contract.LABEL_POOL: contract.POOL_SERVING},
        "ports": [
            {
                "name": PORT_NAME,
                "port": contract.ENGINE_PORT,
                "targetPort": contract.ENGINE_PORT,
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ],
    }


def service(name: str, namespace: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR,
                contract.LABEL_DEPLOYMENT: name,
            },
            "ownerReferences": [owner_reference(name, uid)],
        },
        "spec": service_spec(name),
    }


def _drifted(existing: dict[str, Any], want: dict[str, Any]) -> bool:
    spec = existing.get("spec") or {}
    ports = [{k: p.get(k) for k in want["ports"][0]} for p in spec.get("ports") or []]
    return spec.get("selector") != want["selector"] or ports != want["ports"]


def apply_service(kube: Kube, ns: str, name: str, uid: str, status: ModelDeploymentStatus) -> list[str]:
    """Create the deployment's Service or restore its selector and ports, and say its address in
    `status`. [] when done, [why] when it cannot be (the apiserver refused it, or another owner
    holds the name: no address then)."""
    refused = _apply(kube, ns, name, uid)
    status.address = None if refused else address(name, ns)
    return refused


def _apply(kube: Kube, ns: str, name: str, uid: str) -> list[str]:
    what = f"Service {name}"
    try:
        existing = kube.get(services_path(ns, name))
        if existing is None:
            kube.create(services_path(ns), service(name, ns, uid))
            return []
        owners = (existing.get("metadata") or {}).get("ownerReferences") or []
        if not any(o.get("uid") == uid and o.get("controller") for o in owners):
            return [f"{what} exists and is not this ModelDeployment's: rename or delete it"]
        want = service_spec(name)
        if _drifted(existing, want):
            # A merge patch merges maps: keys someone added to the selector are removed explicitly.
            selector = merge_patch(existing["spec"].get("selector") or {}, want["selector"])
            kube.patch(services_path(ns, name), {"spec": {"selector": selector, "ports": want["ports"]}})
    except KubeError as exc:
        if not exc.rejected:
            raise
        return [f"{what} refused by the API server ({exc.status}): {exc.message}"[:512]]
    return []
