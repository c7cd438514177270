"""Pure builder for SAVE Jobs and readers of their outcome (team.md's SAVE Job contract).

The SAVE container runs `ember save --job` in the engine image with libember preloaded, on ONE GPU
of the archive's product; env `EMBER_IDENTITY` (canonical identity JSON) and `EMBER_STORE`. On
success it writes a JSON summary {manifest_digest, bytes, graphs, durations} to its termination
message; on failure the reason. The operator reads both from the pod status (no extra RBAC).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ember.identity import canonical_json
from ember_operator import API_VERSION, naming
from ember_operator.api import GraphArchiveSpec
from ember_operator.pods import (
    LIB_DIR,
    LIB_MOUNT,
    RUN_AS_USER,
    RUN_DIR,
    StoreAccess,
    _restricted,
    gpu_placement,
    lib_init_container,
)

SAVE_CONTAINER = "save"


def save_job(
    *, name: str, namespace: str, archive_name: str, archive_uid: str, spec: GraphArchiveSpec,
    store: StoreAccess, sidecar_image: str, timeout_seconds: int, attempt: int,
) -> dict[str, Any]:
    ident = spec.identity.to_identity()
    labels = {
        naming.MANAGED_BY: naming.OPERATOR_NAME,
        naming.COMPONENT: "save",
        naming.ARCHIVE_LABEL: archive_name,
        naming.IDENTITY: spec.identity_hash[:16],
        naming.GPU_PRODUCT: ident.gpu_product,
    }
    container = {
        "name": SAVE_CONTAINER,
        "image": spec.save.image,
        "command": ["ember", "save", "--job"],
        "args": list(spec.save.args),
        "env": [
            {"name": "EMBER_IDENTITY", "value": canonical_json(ident.canonical()).decode()},
            {"name": "EMBER_IDENTITY_HASH", "value": spec.identity_hash},
            *store.env(),
            {"name": "EMBER_RUN_DIR", "value": RUN_DIR},
            {"name": "LD_PRELOAD", "value": f"{LIB_DIR}/libember.so"},
            {"name": "EMBER_LIB", "value": f"{LIB_DIR}/libember.so"},
            {"name": "NCCL_CUMEM_ENABLE", "value": "0"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "envFrom": store.env_from(optional=False),
        "resources": {"limits": {naming.GPU_RESOURCE: "1"}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "ember-lib", "mountPath": LIB_DIR, "readOnly": True},
            {"name": "ember-run", "mountPath": RUN_DIR},
            *store.mounts(),
        ],
        "securityContext": _restricted(read_only_root=False),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {"ember.dev/attempt": str(attempt)},
            "ownerReferences": [{
                "apiVersion": API_VERSION, "kind": "GraphArchive", "name": archive_name, "uid": archive_uid,
                "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            "backoffLimit": 0,  # the operator retries with its own backoff, as a new attempt
            "activeDeadlineSeconds": spec.save.timeout_seconds or timeout_seconds,
            "template": {
                "metadata": {"labels": labels, "annotations": dict(spec.save.pod_annotations)},
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": [lib_init_container(sidecar_image) | {
                        "volumeMounts": [{"name": "ember-lib", "mountPath": LIB_MOUNT}],
                    }],
                    "containers": [container],
                    "volumes": [
                        {"name": "ember-lib", "emptyDir": {"sizeLimit": "256Mi"}},
                        {"name": "ember-run", "emptyDir": {}},
                        *store.volumes(),
                    ],
                    "securityContext": {
                        "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                        "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    **gpu_placement(ident.gpu_product),
                },
            },
        },
    }


@dataclass
class SaveResult:
    """What the SAVE pod reported through its termination message."""

    succeeded: bool
    message: str = ""
    manifest_digest: str | None = None
    bytes: int | None = None
    graphs: int | None = None
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        return self.message.strip().splitlines()[-1][:512] if self.message.strip() else ""


def job_state(job: dict[str, Any]) -> str:
    """Active | Succeeded | Failed, from the Job's conditions (the Job controller's verdict)."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "Succeeded"
        if cond.get("status") == "True" and cond.get("type") in ("Failed", "FailureTarget"):
            return "Failed"
    return "Active"


def job_failure(job: dict[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Failed", "FailureTarget") and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip(": ")
    return ""


def read_termination(pod: dict[str, Any]) -> SaveResult | None:
    """The SAVE container's termination state, parsed; None while it has not terminated."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != SAVE_CONTAINER:
            continue
        term = (status.get("state") or {}).get("terminated")
        if not term:
            return None
        message = term.get("message") or ""
        result = SaveResult(succeeded=term.get("exitCode") == 0, message=message)
        try:
            summary = json.loads(message) if message.strip().startswith("{") else None
        except ValueError:
            summary = None
        if isinstance(summary, dict):
            result.manifest_digest = summary.get("manifest_digest")
            result.bytes = _int(summary.get("bytes"))
            result.graphs = _int(summary.get("graphs"))
            durations = summary.get("durations")
            if isinstance(durations, dict):
                result.durations = {
                    str(k): float(v) for k, v in durations.items() if isinstance(v, int | float)
                }
            if not result.succeeded and summary.get("reason"):
                result.message = str(summary["reason"])
        return result
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
