"""Pure builder for SAVE Jobs and readers of their outcome (the SAVE Job part of `ember.contract`).

The SAVE container runs `ember save --job` in the engine image with libember preloaded, on ONE GPU
of the archive's product; env `EMBER_IDENTITY` (canonical identity JSON) and `EMBER_STORE`. On
success it writes a JSON summary {manifest_digest, bytes, graphs, durations} to its termination
message; on failure the reason (`ember.contract.write_termination_log`). The operator reads both
from the pod status (no extra RBAC) into a `contract.SaveResult`.
"""

from __future__ import annotations

from typing import Any

from ember import contract
from ember.contract import SaveResult
from ember.identity import canonical_json, identity_short
from ember_operator import templates
from ember_operator.api import GraphArchiveSpec
from ember_operator.pods import (
    ENGINE_HOME,
    LIB_MOUNT,
    StoreAccess,
    _restricted,
    downward_pod_env,
    gpu_placement,
    lib_init_container,
    libember_env,
    pod_security_context,
)


def save_job(
    *, name: str, namespace: str, archive_name: str, archive_uid: str, spec: GraphArchiveSpec,
    store: StoreAccess, sidecar_image: str, timeout_seconds: int, attempt: int,
) -> dict[str, Any]:
    gpu_product = spec.identity.to_identity().gpu_product
    labels = {
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR,
        contract.LABEL_COMPONENT: "save",
        contract.LABEL_ARCHIVE: archive_name,
        contract.LABEL_IDENTITY: identity_short(spec.identity_hash),
        contract.LABEL_GPU_PRODUCT: gpu_product,
    }
    pod_spec = {
        "restartPolicy": "Never",
        "initContainers": [lib_init_container(sidecar_image) | {
            "volumeMounts": [{"name": "ember-lib", "mountPath": LIB_MOUNT}],
        }],
        "containers": [save_container(spec, store)],
        "volumes": [
            {"name": "ember-lib", "emptyDir": {"sizeLimit": "256Mi"}},
            {"name": "ember-run", "emptyDir": {}},
            {"name": "ember-tmp", "emptyDir": {}},
            *store.volumes(),
            *_signing_volumes(spec),
        ],
        "securityContext": pod_security_context(),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        **gpu_placement(gpu_product),
    }
    pod_spec = templates.apply_spec(pod_spec, spec.save.template)
    if spec.save.priority_class_name:  # a presave's low priority wins over the template's
        pod_spec["priorityClassName"] = spec.save.priority_class_name
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {contract.ANN_SAVE_ATTEMPT: str(attempt)},
            "ownerReferences": [{
                "apiVersion": contract.API_VERSION, "kind": contract.KIND_GRAPH_ARCHIVE, "name": archive_name,
                "uid": archive_uid, "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            "backoffLimit": 0,  # the operator retries with its own backoff, as a new attempt
            "activeDeadlineSeconds": spec.save.timeout_seconds or timeout_seconds,
            "template": {
                "metadata": templates.apply_metadata(
                    {"labels": labels, "annotations": dict(spec.save.pod_annotations)}, spec.save.template),
                "spec": pod_spec,
            },
        },
    }


def save_container(spec: GraphArchiveSpec, store: StoreAccess) -> dict[str, Any]:
    """`ember save --job` in the engine image, under libember, on one GPU."""
    ident = spec.identity.to_identity()
    return {
        "name": contract.SAVE_CONTAINER,
        "image": spec.save.image,
        "command": ["ember", "save", "--job", "--"],  # engine.args follow (vLLM's, `ember serve`'s)
        "args": list(spec.save.args),
        "env": [
            {"name": contract.ENV_IDENTITY, "value": canonical_json(ident.canonical()).decode()},
            {"name": contract.ENV_IDENTITY_HASH, "value": spec.identity_hash},
            *store.env(),
            {"name": contract.ENV_RUN_DIR, "value": contract.RUN_DIR},
            *([{"name": contract.ENV_SIGNING_KEY, "value": contract.SIGNING_KEY_PATH}]
              if spec.save.signing_secret else []),
            *libember_env(),
            {"name": "NCCL_CUMEM_ENABLE", "value": "0"},
            *downward_pod_env(),
            *ENGINE_HOME,
        ],
        "envFrom": store.env_from(optional=False),
        # Requests as the serving engine's (never BestEffort), one GPU whatever the shape.
        "resources": {"requests": dict(spec.save.resources.requests),
                      "limits": {**spec.save.resources.resolved_limits(), contract.GPU_RESOURCE: "1"}},
        "terminationMessagePath": contract.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "ember-lib", "mountPath": contract.LIB_DIR, "readOnly": True},
            {"name": "ember-run", "mountPath": contract.RUN_DIR},
            {"name": "ember-tmp", "mountPath": "/tmp"},
            *store.mounts(),
            *([{"name": SIGNING_VOLUME, "mountPath": contract.SIGNING_KEY_DIR, "readOnly": True}]
              if spec.save.signing_secret else []),
        ],
        "securityContext": _restricted(read_only_root=True),
    }


SIGNING_VOLUME = "ember-signing"


def _signing_volumes(spec: GraphArchiveSpec) -> list[dict[str, Any]]:
    """The signing Secret's key file (readable by the pod's non-root user through fsGroup)."""
    if not spec.save.signing_secret:
        return []
    return [{"name": SIGNING_VOLUME, "secret": {
        "secretName": spec.save.signing_secret, "defaultMode": 0o440,
        "items": [{"key": contract.SIGNING_SECRET_KEY, "path": contract.SIGNING_SECRET_KEY}]}}]


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


def pod_stuck(pod: dict[str, Any]) -> str:
    """Why a SAVE pod cannot start ("" when it can): unschedulable (the scheduler's message, e.g.
    no node with the GPU product) or an image that cannot be pulled."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message', '')}".strip(": ")
    for cs in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                                     "CreateContainerConfigError"):
            return f"{waiting['reason']}: {cs.get('name')}: {waiting.get('message', '')}".strip(": ")
    return ""


def read_termination(pod: dict[str, Any]) -> SaveResult | None:
    """The SAVE container's termination state, parsed; None while it has not terminated."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != contract.SAVE_CONTAINER:
            continue
        term = (status.get("state") or {}).get("terminated")
        if not term:
            return None
        return SaveResult.from_termination(term.get("exitCode"), term.get("message") or "")
    return None
