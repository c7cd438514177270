"""Pure builders for serving and warm pods (manifests as dicts; nothing here talks to the API).

A pod is built from a `PodTemplate`: what a warm pod of a pool needs to be claimable by any
ModelDeployment of the pool (GPU, engine image, store). A claim adds labels and annotations
(`claim_patch`); a cold pod is a template pod created already claimed.

Every pod has:
- the engine container with `LD_PRELOAD=/opt/ember/lib/libember.so`, `EMBER_RUN_DIR`, the
  downward API files (`/etc/ember/podinfo/{labels,annotations}`, updated live on claim);
- an init container copying libember.so from the sidecar image into a shared emptyDir;
- the sidecar as a native sidecar (an init container with `restartPolicy: Always`);
- non-root, no privilege escalation, all capabilities dropped, seccomp RuntimeDefault, no host
  paths; the sidecar's root filesystem is read-only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember_operator import naming
from ember_operator.api import StoreSpec

RUN_DIR = "/var/run/ember"
LIB_DIR = "/opt/ember/lib"
LIB_PATH = f"{LIB_DIR}/libember.so"
LIB_MOUNT = "/ember-lib"
PODINFO_DIR = "/etc/ember/podinfo"
SIDECAR_PORT = 9400  # the sidecar's /readyz, /livez, /metrics
RUN_AS_USER = 65532


@dataclass(frozen=True)
class StoreAccess:
    """How a container reaches the store: URI, endpoint, credentials secret, optional PVC."""

    uri: str
    endpoint: str = ""
    region: str = ""
    credentials_secret: str = ""
    pvc: str = ""
    local_path: str = ""

    @classmethod
    def of(cls, store: StoreSpec | None, default_uri: str = "", default_endpoint: str = "") -> StoreAccess:
        if store is None:
            return cls(uri=default_uri, endpoint=default_endpoint)
        if store.s3 is not None:
            return cls(
                uri=store.uri(), endpoint=store.s3.endpoint or "", region=store.s3.region or "",
                credentials_secret=store.s3.credentials_secret or "",
            )
        local = store.local
        if local is None:
            raise ValueError("store: set exactly one of s3 and local")
        return cls(uri=store.uri(), pvc=local.persistent_volume_claim or "", local_path=local.path)

    def open_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.endpoint:
            opts["endpoint"] = self.endpoint
        if self.region:
            opts["region"] = self.region
        return opts

    def env(self) -> list[dict[str, Any]]:
        env = [{"name": "EMBER_STORE", "value": self.uri}]
        if self.endpoint:
            env.append({"name": "EMBER_S3_ENDPOINT", "value": self.endpoint})
        if self.region:
            env.append({"name": "AWS_REGION", "value": self.region})
        return env

    def env_from(self, optional: bool) -> list[dict[str, Any]]:
        if not self.credentials_secret:
            return []
        return [{"secretRef": {"name": self.credentials_secret, "optional": optional}}]

    def volumes(self) -> list[dict[str, Any]]:
        if not self.pvc:
            return []
        return [{"name": "ember-store", "persistentVolumeClaim": {"claimName": self.pvc}}]

    def mounts(self) -> list[dict[str, Any]]:
        if not self.pvc:
            return []
        return [{"name": "ember-store", "mountPath": self.local_path}]


@dataclass(frozen=True)
class PodTemplate:
    """Everything a pool's pods share. Two deployments with equal templates share warm pods."""

    namespace: str
    gpu_product: str
    gpu_count: int
    engine_kind: str
    engine_version: str
    engine_image: str
    sidecar_image: str
    store: StoreAccess
    service_account: str = ""

    @property
    def pool_key(self) -> str:
        return naming.short_hash(
            self.gpu_product, self.gpu_count, self.engine_kind, self.engine_version, self.engine_image,
            self.sidecar_image, self.store.uri, self.store.endpoint, self.store.credentials_secret,
            self.store.pvc, length=16,
        )


@dataclass(frozen=True)
class Claim:
    """What a claim writes onto a pod (team.md pod protocol)."""

    deployment: str
    deployment_uid: str
    identity_hash: str
    identity_json: str
    revision: str
    archive_uri: str  # "" → native capture
    engine_args: tuple[str, ...] = ()
    claimed_at: str = ""
    native_reason: str = ""  # why archive_uri is empty (the ArchiveReady reason), for the sidecar

    def labels(self) -> dict[str, str]:
        return {
            naming.POOL: naming.POOL_SERVING,
            naming.DEPLOYMENT: self.deployment,
            naming.IDENTITY: self.identity_hash[:16],
            naming.REVISION: self.revision,
        }

    def annotations(self) -> dict[str, str]:
        out = {
            naming.ARCHIVE: self.archive_uri,
            naming.IDENTITY: self.identity_hash,
            naming.IDENTITY_SPEC: self.identity_json,
            naming.ENGINE_ARGS: json.dumps(list(self.engine_args)),
            naming.RANK: "0",
            naming.WORLD: "1",
        }
        if self.claimed_at:
            out[naming.CLAIMED_AT] = self.claimed_at
        if not self.archive_uri:
            out[naming.NATIVE_REASON] = self.native_reason or "NoArchive"
        return out

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": "ember.dev/v1alpha1", "kind": "ModelDeployment", "name": self.deployment,
            "uid": self.deployment_uid, "controller": True, "blockOwnerDeletion": True,
        }


def _restricted(read_only_root: bool) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "EMBER_RUN_DIR", "value": RUN_DIR},
        {"name": "EMBER_PODINFO_DIR", "value": PODINFO_DIR},
    ]


def gpu_placement(product: str) -> dict[str, Any]:
    """Node selector and toleration that put a pod on the named GPU product."""
    return {
        "nodeSelector": {naming.GPU_PRODUCT_NODE_LABEL: product},
        "tolerations": [{"key": naming.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }


def lib_init_container(sidecar_image: str) -> dict[str, Any]:
    """Copies libember.so from the ember image into the shared volume (for LD_PRELOAD)."""
    return {
        "name": "ember-lib",
        "image": sidecar_image,
        "command": ["cp", LIB_PATH, f"{LIB_MOUNT}/libember.so"],
        "volumeMounts": [{"name": "ember-lib", "mountPath": LIB_MOUNT}],
        "securityContext": _restricted(read_only_root=True),
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
    }


def pod_spec(t: PodTemplate) -> dict[str, Any]:
    shared_mounts = [
        {"name": "ember-run", "mountPath": RUN_DIR},
        {"name": "ember-podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
    ]
    sidecar = {
        "name": "ember-sidecar",
        "image": t.sidecar_image,
        "command": ["ember-sidecar"],
        "restartPolicy": "Always",
        "env": [*_downward_env(), *t.store.env(),
                {"name": "EMBER_SIDECAR_PORT", "value": str(SIDECAR_PORT)}],
        "envFrom": t.store.env_from(optional=True),
        "ports": [{"name": "ember-sidecar", "containerPort": SIDECAR_PORT}],
        # Ready when the engine took the restored graphs (or captured natively) and serves.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": SIDECAR_PORT}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": SIDECAR_PORT}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [*shared_mounts, {"name": "ember-tmp", "mountPath": "/tmp"}, *t.store.mounts()],
        "securityContext": _restricted(read_only_root=True),
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
    }
    engine = {
        "name": "engine",
        "image": t.engine_image,
        "env": [
            *_downward_env(),
            {"name": "LD_PRELOAD", "value": f"{LIB_DIR}/libember.so"},
            {"name": "EMBER_LIB", "value": f"{LIB_DIR}/libember.so"},
            {"name": "EMBER_ENGINE", "value": t.engine_kind},
            {"name": "NCCL_CUMEM_ENABLE", "value": "0"},
        ],
        "volumeMounts": [*shared_mounts, {"name": "ember-lib", "mountPath": LIB_DIR, "readOnly": True}],
        "resources": {"limits": {naming.GPU_RESOURCE: str(t.gpu_count)}},
        "securityContext": _restricted(read_only_root=False),
    }
    spec: dict[str, Any] = {
        "initContainers": [lib_init_container(t.sidecar_image), sidecar],
        "containers": [engine],
        "volumes": [
            {"name": "ember-lib", "emptyDir": {"sizeLimit": "256Mi"}},
            {"name": "ember-run", "emptyDir": {}},
            {"name": "ember-tmp", "emptyDir": {"sizeLimit": "256Mi"}},
            {"name": "ember-podinfo", "downwardAPI": {"items": [
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            ]}},
            *t.store.volumes(),
        ],
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        **gpu_placement(t.gpu_product),
    }
    if t.service_account:
        spec["serviceAccountName"] = t.service_account
    return spec


def base_labels(t: PodTemplate) -> dict[str, str]:
    return {
        naming.MANAGED_BY: naming.OPERATOR_NAME,
        naming.COMPONENT: "engine",
        naming.GPU_PRODUCT: t.gpu_product,
        naming.POOL_KEY: t.pool_key,
    }


def prefetch_annotation(uris: list[str]) -> str:
    return json.dumps(sorted(set(uris)))


def warm_pod(t: PodTemplate, prefetch: list[str] | None = None) -> dict[str, Any]:
    """An unclaimed pod of the pool (generateName; the pool is counted, never named).

    `prefetch`: manifests of the archives its deployments use; the sidecar caches them while the
    pod is warm (xLoRA's pre-loading), so a claim only hands them over.
    """
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": naming.warm_pod_prefix(t.pool_key),
            "namespace": t.namespace,
            "labels": {**base_labels(t), naming.POOL: naming.POOL_WARM},
            "annotations": {naming.PREFETCH: prefetch_annotation(prefetch or [])},
        },
        "spec": pod_spec(t),
    }


def serving_pod(t: PodTemplate, claim: Claim, name: str) -> dict[str, Any]:
    """A cold pod: created already claimed, with a deterministic name."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": t.namespace,
            "labels": {**base_labels(t), **claim.labels()},
            "annotations": claim.annotations(),
            "ownerReferences": [claim.owner_reference()],
        },
        "spec": pod_spec(t),
    }


def claim_patch(claim: Claim, resource_version: str) -> dict[str, Any]:
    """Merge patch turning a warm pod into a serving pod of `claim.deployment`.

    `resourceVersion` makes it conditional: if another deployment claimed the pod first, the
    patch fails with 409 Conflict and the claimer moves on to the next warm pod.
    """
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "labels": claim.labels(),
            "annotations": claim.annotations(),
            "ownerReferences": [claim.owner_reference()],
        }
    }
