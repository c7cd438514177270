"""Spec-level placement checks: can the deployment's pods be placed at all?

A GPU product no node carries, or a PersistentVolumeClaim that does not exist, would leave every
SAVE and serving pod Pending with nothing in the deployment's status to say why. The operator
checks both when the spec changes (and while a problem stands) and reports a `Schedulable`
condition. Best effort: without RBAC to read nodes or PVCs the check is skipped.
"""

from __future__ import annotations

import logging

from ember import contract
from ember_operator.kube import Kube, KubeError

log = logging.getLogger("ember_operator")
CONDITION = "Schedulable"


def placement_problem(kube: Kube, ns: str, gpu_product: str, pvc: str) -> tuple[str, str] | None:
    """(reason, message) of the first problem found, or None when the pods can be placed."""
    try:
        nodes = kube.request("GET", "/api/v1/nodes", query={
            "labelSelector": f"{contract.GPU_PRODUCT_NODE_LABEL}={gpu_product}", "limit": "1",
        }).get("items") or []
        if not nodes:
            return ("GpuProductUnavailable",
                    f"no node has GPU product {gpu_product} (node label {contract.GPU_PRODUCT_NODE_LABEL}): "
                    "SAVE and serving pods stay Pending until one joins")
        if pvc:
            claim = kube.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{pvc}")
            if claim is None:
                return ("PersistentVolumeClaimMissing",
                        f"PersistentVolumeClaim {pvc} (spec.store.local) does not exist in {ns}: "
                        "pods that mount it stay Pending")
            phase = (claim.get("status") or {}).get("phase")
            if phase == "Lost":
                return "PersistentVolumeClaimLost", f"PersistentVolumeClaim {pvc} is Lost (no volume)"
    except KubeError as exc:  # no RBAC, or the apiserver is busy: skip, the next change retries
        log.debug("Placement check in %s skipped: %s", ns, exc)
    return None


def largest_node_gpus(kube: Kube, gpu_product: str) -> int | None:
    """The most allocatable GPUs of one node of `gpu_product` (None: unknown, e.g. no RBAC)."""
    try:
        nodes = kube.request("GET", "/api/v1/nodes", query={
            "labelSelector": f"{contract.GPU_PRODUCT_NODE_LABEL}={gpu_product}"}).get("items") or []
    except KubeError as exc:
        log.debug("Node sizes of %s unknown: %s", gpu_product, exc)
        return None
    sizes = [str(((n.get("status") or {}).get("allocatable") or {}).get(contract.GPU_RESOURCE, "0"))
             for n in nodes]
    return max((int(s) for s in sizes if s.isdigit()), default=0)
