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
  paths, read-only root filesystems (writable: emptyDirs at /tmp and the run dir);
- no automounted service account token: only the sidecar (which watches and annotates its own
  pod) gets a projected, pod-bound token; the engine container has no API credentials.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ember import contract, settings
from ember.contract import Claim
from ember.identity import identity_short
from ember_operator import naming, templates
from ember_operator.api import StoreSpec

LIB_MOUNT = "/ember-lib"  # where the lib init container copies libember.so to
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where in-cluster clients look
SA_TOKEN_SECONDS = 3600  # the kubelet refreshes the projected token at 80 % of its life
# Writable scratch of engine processes on a read-only root (caches, Hugging Face downloads).
ENGINE_HOME = [{"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"}]
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
        env = [{"name": contract.ENV_STORE, "value": self.uri}]
        if self.endpoint:
            env.append({"name": contract.ENV_S3_ENDPOINT, "value": self.endpoint})
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
    # The engine container's requests and limits (GPUs added from gpu_count), as sorted pairs.
    engine_requests: tuple[tuple[str, str], ...] = ()
    engine_limits: tuple[tuple[str, str], ...] = ()
    trusted_keys: str = ""  # EMBER_TRUSTED_KEYS of sidecar and engine; "" → not set
    patch: str = ""  # spec.template (templates.encode); "" → none
    # priorityClassName of warm and of cold serving pods ("" → the default priority); not in
    # pool_key: a claimed warm pod keeps its class (a pod's priority is fixed at creation).
    warm_priority_class: str = ""
    serving_priority_class: str = ""
    # transformers: `ember serve`'s arguments after the pod's own (contract.serve_args: the model,
    # then engine.args), in the engine container's command from the pod's creation; () for vLLM,
    # whose `ember serve --engine vllm` takes them from the claim.
    serve_args: tuple[str, ...] = ()

    @property
    def pool_key(self) -> str:
        # The trust list, the template and the serve arguments only when set, so the pools of
        # deployments without them keep their keys. A transformers pod runs its model from its
        # creation: its pool is that model's and those arguments' only.
        return naming.short_hash(
            self.gpu_product, self.gpu_count, self.engine_kind, self.engine_version, self.engine_image,
            self.sidecar_image, self.store.uri, self.store.endpoint, self.store.credentials_secret,
            self.store.pvc, list(self.engine_requests), list(self.engine_limits),
            *([self.trusted_keys] if self.trusted_keys else []), *([self.patch] if self.patch else []),
            *([list(self.serve_args)] if self.serve_args else []),
            length=16,
        )

    def trust_env(self) -> list[dict[str, Any]]:
        return [{"name": contract.ENV_TRUSTED_KEYS, "value": self.trusted_keys}] if self.trusted_keys else []


def owner_reference(deployment: str, uid: str) -> dict[str, Any]:
    """The ModelDeployment owns its serving pods (deleted with it; one controller)."""
    return {
        "apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT, "name": deployment,
        "uid": uid, "controller": True, "blockOwnerDeletion": True,
    }


def _restricted(read_only_root: bool) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def downward_pod_env() -> list[dict[str, Any]]:
    """The pod's name and namespace (downward API)."""
    return [
        {"name": contract.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": contract.ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def _downward_env() -> list[dict[str, Any]]:
    return [
        *downward_pod_env(),
        {"name": contract.ENV_POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": contract.ENV_RUN_DIR, "value": contract.RUN_DIR},
        {"name": contract.ENV_PODINFO_DIR, "value": contract.PODINFO_DIR},
    ]


def libember_env() -> list[dict[str, Any]]:
    """An engine process under libember: preloaded, told where the library is, and the knobs a pod
    never takes from outside (a test's fault, a bench's skipped canary, an unproven layout:
    `settings.PINNED`) pinned to their defaults."""
    return [
        {"name": "LD_PRELOAD", "value": contract.LIB_PATH},
        {"name": contract.ENV_LIB, "value": contract.LIB_PATH},
        *settings.pinned_env(),
    ]


def gpu_placement(product: str) -> dict[str, Any]:
    """Node selector and toleration that put a pod on the named GPU product."""
    return {
        "nodeSelector": {contract.GPU_PRODUCT_NODE_LABEL: product},
        "tolerations": [{"key": contract.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }


def lib_init_container(sidecar_image: str) -> dict[str, Any]:
    """Copies libember.so from the ember image into the shared volume (for LD_PRELOAD)."""
    return {
        "name": contract.LIB_CONTAINER,
        "image": sidecar_image,
        "command": ["cp", contract.LIB_PATH, f"{LIB_MOUNT}/{contract.LIB_NAME}"],
        "volumeMounts": [{"name": "ember-lib", "mountPath": LIB_MOUNT}],
        "securityContext": _restricted(read_only_root=True),
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
    }


def _shared_mounts() -> list[dict[str, Any]]:
    """The run directory and the downward API files, in the engine and the sidecar."""
    return [
        {"name": "ember-run", "mountPath": contract.RUN_DIR},
        {"name": "ember-podinfo", "mountPath": contract.PODINFO_DIR, "readOnly": True},
    ]


def sidecar_container(t: PodTemplate) -> dict[str, Any]:
    """The sidecar, a native sidecar (init container with restartPolicy Always)."""
    port = contract.SIDECAR_PORT
    return {
        "name": contract.SIDECAR_CONTAINER,
        "image": t.sidecar_image,
        "command": ["ember-sidecar"],
        "restartPolicy": "Always",
        "env": [*_downward_env(), *t.store.env(), {"name": contract.ENV_SIDECAR_PORT, "value": str(port)},
                *t.trust_env()],
        "envFrom": t.store.env_from(optional=True),
        "ports": [{"name": "ember-sidecar", "containerPort": port}],
        # Ready when the engine took the restored graphs (or captured natively) and serves.
        "readinessProbe": {"httpGet": {"path": contract.READYZ, "port": port}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": contract.LIVEZ, "port": port}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [*_shared_mounts(), {"name": "ember-tmp", "mountPath": "/tmp"}, *t.store.mounts(),
                         {"name": "ember-sa-token", "mountPath": SA_TOKEN_DIR, "readOnly": True}],
        "securityContext": _restricted(read_only_root=True),
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
    }


def engine_command(t: PodTemplate) -> dict[str, Any]:
    """`ember serve` behind the sidecar's hand-off, on every address of the engine port.
    vLLM: it supervises `vllm serve` (ember.serving.vllm), which it starts after the hand-off with
    the claim's arguments (the identity's and `engine.args`) under libember, or natively with the
    reason. transformers: it serves the model and sizing of `t.serve_args` (built before any claim,
    restored from the handed-off archive or captured natively) and refuses a claim of others."""
    if t.engine_kind == "vllm":
        return {"command": ["ember", "serve", "--engine", "vllm", "--run-dir", contract.RUN_DIR, "--",
                            "--host", "0.0.0.0", "--port", str(contract.ENGINE_PORT)]}
    return {"command": ["ember", "serve", "--run-dir", contract.RUN_DIR, "--host", "0.0.0.0",
                        "--port", str(contract.ENGINE_PORT), *t.serve_args]}


def engine_container(t: PodTemplate, extra_env: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """The engine image, under libember, with the run directory and the pod's labels/annotations
    (`extra_env`: what only some pods of the template get, e.g. a warm pod's EMBER_WARM_ENGINE)."""
    return {
        "name": contract.ENGINE_CONTAINER,
        "image": t.engine_image,
        **engine_command(t),
        # vLLM's and `ember serve`'s HTTP port: the deployment's Service targets it.
        "ports": [{"name": "http", "containerPort": contract.ENGINE_PORT, "protocol": "TCP"}],
        "env": [
            *_downward_env(),
            *libember_env(),
            {"name": contract.ENV_ENGINE, "value": t.engine_kind},
            {"name": "NCCL_CUMEM_ENABLE", "value": "0"},
            *ENGINE_HOME,
            *t.trust_env(),  # LOAD checks the cached archive's signature again
            *extra_env,
        ],
        "volumeMounts": [*_shared_mounts(),
                         {"name": "ember-lib", "mountPath": contract.LIB_DIR, "readOnly": True},
                         {"name": "ember-engine-tmp", "mountPath": "/tmp"}],
        "resources": engine_resources(t),
        # Read-only root: the engine writes only to /tmp, the run dir (emptyDirs) and the store mount.
        "securityContext": _restricted(read_only_root=True),
    }


def engine_resources(t: PodTemplate) -> dict[str, Any]:
    """Requests give a CPU/memory-utilization HPA something to divide by; GPUs as requests = limits."""
    gpus = {contract.GPU_RESOURCE: str(t.gpu_count)}
    return {"requests": {**dict(t.engine_requests), **gpus}, "limits": {**dict(t.engine_limits), **gpus}}


def _pod_volumes(t: PodTemplate) -> list[dict[str, Any]]:
    return [
        {"name": "ember-lib", "emptyDir": {"sizeLimit": "256Mi"}},
        {"name": "ember-run", "emptyDir": {}},
        {"name": "ember-tmp", "emptyDir": {"sizeLimit": "256Mi"}},
        {"name": "ember-engine-tmp", "emptyDir": {}},
        sa_token_volume(),
        {"name": "ember-podinfo", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
        ]}},
        *t.store.volumes(),
    ]


def sa_token_volume() -> dict[str, Any]:
    """What automount would give, as a volume mounted into the sidecar only: a pod-bound token
    (its pod-name claim lets the chart's admission policy limit writes to the pod itself)."""
    return {"name": "ember-sa-token", "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": SA_TOKEN_SECONDS}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_spec(t: PodTemplate, priority_class: str = "", *, warm: bool = False,
             engine_env: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "initContainers": [lib_init_container(t.sidecar_image), sidecar_container(t)],
        "containers": [engine_container(t, engine_env)],
        "volumes": _pod_volumes(t),
        "securityContext": pod_security_context(),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        **gpu_placement(t.gpu_product),
    }
    if t.service_account:
        spec["serviceAccountName"] = t.service_account
    spec = templates.apply_spec(spec, templates.decode(t.patch))
    # after the template: a warm pod's class always wins (warm pods must stay preemptible); a
    # serving pod keeps a class its template names
    if priority_class and (warm or "priorityClassName" not in spec):
        spec["priorityClassName"] = priority_class
    return spec


def base_labels(t: PodTemplate) -> dict[str, str]:
    return {
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR,
        contract.LABEL_COMPONENT: "engine",
        contract.LABEL_GPU_PRODUCT: t.gpu_product,
        contract.LABEL_POOL_KEY: t.pool_key,
    }


def _pod(t: PodTemplate, meta: dict[str, Any], priority_class: str, *, warm: bool,
         engine_env: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A pod of template `t`: `meta` (name, labels, annotations, owners) under the template's
    metadata patch, the pod spec at `priority_class`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": templates.apply_metadata({"namespace": t.namespace, **meta}, templates.decode(t.patch)),
        "spec": pod_spec(t, priority_class, warm=warm, engine_env=engine_env),
    }


def warm_pod(t: PodTemplate, prefetch: list[str] | None = None, name: str = "") -> dict[str, Any]:
    """An unclaimed pod of the pool, named `name` (`naming.warm_pod_names`; generateName when "").

    `prefetch`: manifests of the archives its deployments use; the sidecar caches them while the
    pod is warm (xLoRA's pre-loading), so a claim only hands them over.
    """
    return _pod(t, {
        **({"name": name} if name else {"generateName": naming.warm_pod_prefix(t.pool_key)}),
        "labels": {**base_labels(t), contract.LABEL_POOL: contract.POOL_WARM},
        "annotations": {contract.ANN_PREFETCH: contract.prefetch_annotation(prefetch or [])},
    }, t.warm_priority_class, warm=True)


def bound_key(pool_key: str, deployment: str, claim: Claim,
              warm_engine: str = contract.WARM_ENGINE_READY) -> str:
    """The pool key of a deployment's identity-keyed warm pods: its pod template, the deployment,
    and everything the engine starts from before a claim (archive and its digest, identity, engine
    arguments, rank layout, how it idles: `warm_engine`). A replaced archive, edited arguments or
    another warm engine mode make another pool."""
    # the mode only when not the default, so the pools of deployments that never set it keep their keys
    mode = [] if warm_engine == contract.WARM_ENGINE_READY else [warm_engine]
    return naming.short_hash(
        "bound", pool_key, deployment, claim.archive_uri, claim.identity, claim.manifest_digest,
        list(claim.engine_args), claim.rank, claim.world, *mode, length=16,
    )


def bound_warm_pod(
    t: PodTemplate, claim: Claim, deployment: str, owner_uid: str, name: str,
    warm_engine: str = contract.WARM_ENGINE_READY,
) -> dict[str, Any]:
    """An identity-keyed warm pod of `deployment`: unclaimed (pool warm, no deployment label, so
    no Service or HPA selector matches it) but carrying the claim's hand-off data from creation,
    so its sidecar fetches and verifies at once and its engine LOADs before any claim, then idles
    as `warm_engine` says (its EMBER_WARM_ENGINE). Owned by the deployment (deleted with it). The
    claim adds the labels and the claim stamp."""
    key = bound_key(t.pool_key, deployment, claim, warm_engine)
    return _pod(t, {
        "name": name,
        "labels": {**base_labels(t), contract.LABEL_POOL_KEY: key,
                   contract.LABEL_POOL: contract.POOL_WARM, contract.LABEL_WARM_FOR: deployment,
                   contract.LABEL_IDENTITY: identity_short(claim.identity)},
        "annotations": replace(claim, claimed_at=None).annotations(),
        "ownerReferences": [owner_reference(deployment, owner_uid)],
    }, t.warm_priority_class, warm=True,
        engine_env=({"name": contract.ENV_WARM_ENGINE, "value": warm_engine},))


def serving_pod(t: PodTemplate, claim: Claim, name: str, owner_uid: str) -> dict[str, Any]:
    """A cold pod: created already claimed, with a deterministic name."""
    return _pod(t, {
        "name": name,
        "labels": {**base_labels(t), **claim.labels()},
        "annotations": claim.annotations(),
        "ownerReferences": [owner_reference(claim.deployment, owner_uid)],
    }, t.serving_priority_class, warm=False)


def claim_patch(claim: Claim, resource_version: str, owner_uid: str) -> dict[str, Any]:
    """Merge patch turning a warm pod into a serving pod of `claim.deployment`.

    `resourceVersion` makes it conditional: if another deployment claimed the pod first, the
    patch fails with 409 Conflict and the claimer moves on to the next warm pod.
    """
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "labels": claim.labels(),
            "annotations": claim.annotations(),
            "ownerReferences": [owner_reference(claim.deployment, owner_uid)],
        }
    }
