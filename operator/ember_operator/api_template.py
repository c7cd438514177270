"""`spec.template`: a pod template patch for a ModelDeployment's serving and SAVE pods.

The fields a platform needs (env/envFrom, volumes and mounts, tolerations, imagePullSecrets,
serviceAccountName, priorityClassName, affinity, nodeSelector, labels, annotations, the engine
container's resources), in the shape of a PodTemplateSpec so that it reads like the KServe or
Dynamo patches it mirrors. `ember_operator.templates.apply` merges it into the pods ember builds.
What ember owns is refused at admission by the CEL rules below, each saying what and why: its
containers other than the engine, LD_PRELOAD and EMBER_* variables, its volumes (`ember-*`) and
mount paths, security contexts, its labels and annotations, the GPU node selector and GPUs.
Fields outside this schema are unknown fields (kubectl's strict field validation refuses them).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from ember import contract
from ember_operator.api_base import KEYS_RULE, MAX_MAP_ENTRIES, ApiModel, MapValue, cel

# A Kubernetes type ember passes on as it is (affinity, volume sources, envFrom entries).
OPEN: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
OPEN_OBJECT: dict[str, Any] = {"type": "object", **OPEN}
Open = dict[str, Any]
Name = Annotated[str, Field(min_length=1, max_length=253)]
_SHORT_LIST = 32

# Paths ember mounts: the run directory, libember, the pod info, the token, the signing key.
OWNED_PATHS = (
    contract.RUN_DIR,
    contract.LIB_DIR,
    contract.PODINFO_DIR,
    contract.SIGNING_KEY_DIR,
    "/var/run/secrets/kubernetes.io/serviceaccount",
    "/tmp",
)
OWNED_ENV = (contract.ENV_POD_NAME, contract.ENV_POD_NAMESPACE, contract.ENV_POD_UID, "NCCL_CUMEM_ENABLE")


def _not_under(var: str, paths: tuple[str, ...]) -> str:
    return " && ".join(f"!({var} == '{p}' || {var}.startsWith('{p}/'))" for p in paths)


def _owned(what: str, why: str) -> str:
    return f"{what}: ember's ({why}); spec.template cannot set it"


class EnvVar(ApiModel):
    """An environment variable of the engine container (Kubernetes EnvVar)."""

    name: str = Field(min_length=1, max_length=253, description="Variable name.")
    value: str | None = Field(None, max_length=32768, description="Value.")
    value_from: Open | None = Field(
        None,
        description="Source (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef).",
        json_schema_extra=OPEN,
    )


class VolumeMount(ApiModel):
    """A mount in the engine container (Kubernetes VolumeMount)."""

    name: str = Field(min_length=1, max_length=63, description="Volume name.")
    mount_path: str = Field(min_length=1, max_length=512, pattern=r"^/", description="Absolute path.")
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, max_length=512, description="Path within the volume.")


class Volume(ApiModel):
    """A pod volume (Kubernetes Volume: name plus one source, e.g. persistentVolumeClaim, secret,
    emptyDir {medium: Memory} for /dev/shm)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=OPEN)
    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Volume name (DNS label).",
    )


_RESOURCE_RULES = cel(
    (f"!('{contract.GPU_RESOURCE}' in self)", f"{contract.GPU_RESOURCE} comes from spec.gpu.count"),
    ("self.all(k, isQuantity(self[k]))", "resources: values must be quantities (e.g. 4, 500m, 16Gi)"),
)
ResourceList = dict[Annotated[str, Field(max_length=253)], Annotated[str, Field(max_length=64)]]


class Resources(ApiModel):
    """Requests and limits merged over spec.engine.resources (any resource, e.g. hugepages-2Mi or
    an RDMA device; GPUs stay spec.gpu.count)."""

    requests: ResourceList = Field(
        default_factory=dict, max_length=16, json_schema_extra=_RESOURCE_RULES, description="Requests."
    )
    limits: ResourceList = Field(
        default_factory=dict, max_length=16, json_schema_extra=_RESOURCE_RULES, description="Limits."
    )


_CONTAINER_RULES = cel(
    (
        f"self.name == '{contract.ENGINE_CONTAINER}'",
        f"template.spec.containers: only the engine container ('{contract.ENGINE_CONTAINER}') can be "
        f"patched; {contract.SIDECAR_CONTAINER} and {contract.LIB_CONTAINER} are ember's",
    ),
    (
        "!has(self.securityContext)",
        _owned("the engine's securityContext", "non-root, read-only root, no capabilities"),
    ),
    ("!has(self.image)", "the engine's image is spec.engine.image"),
    (
        "!has(self.command) && !has(self.args)",
        "the engine's command and args are ember's (`ember serve`: it runs the deployment's model and "
        "spec.engine.args behind the sidecar's hand-off, and starts `vllm serve` for engine.kind vllm); "
        "spec.template cannot set them: give engine arguments in spec.engine.args",
    ),
)


class ContainerPatch(ApiModel):
    """The engine container's additions (SAVE pods: the SAVE container's)."""

    model_config = ConfigDict(json_schema_extra=_CONTAINER_RULES)
    name: str = Field(min_length=1, max_length=63, description=f"'{contract.ENGINE_CONTAINER}'.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Variables (e.g. HF_TOKEN from a Secret); one "
        "of ember's defaults (HOME, XDG_CACHE_HOME) is replaced by a variable of the same name.",
        json_schema_extra=cel(
            (
                f"self.all(e, e.name != 'LD_PRELOAD' && !e.name.startsWith('EMBER_') && !(e.name in "
                f"{list(OWNED_ENV)}))",
                _owned("LD_PRELOAD, EMBER_* and " + ", ".join(OWNED_ENV), "libember and the pod contract"),
            )
        ),
    )
    env_from: list[Open] = Field(
        default_factory=list,
        max_length=_SHORT_LIST,
        description="Secrets and ConfigMaps as variables (EnvFromSource).",
        json_schema_extra={"items": OPEN_OBJECT},
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=_SHORT_LIST,
        description="Mounts of template.spec.volumes.",
        json_schema_extra=cel(
            (
                f"self.all(m, {_not_under('m.mountPath', OWNED_PATHS)})",
                _owned(
                    ", ".join(OWNED_PATHS) + " and below", "run directory, libember, pod info, token, scratch"
                ),
            )
        ),
    )
    resources: Resources | None = Field(None, description="Requests and limits over spec.engine.resources.")
    security_context: Open | None = Field(None, description="Refused: ember's.", json_schema_extra=OPEN)
    image: str | None = Field(None, description="Refused: spec.engine.image.")
    command: list[str] | None = Field(None, description="Refused: ember's (`ember serve`).")
    args: list[str] | None = Field(None, description="Refused: ember's (`ember serve`); engine arguments "
                                   "are spec.engine.args.")


class Toleration(ApiModel):
    """A toleration added to ember's nvidia.com/gpu one."""

    key: str | None = Field(None, max_length=316, description="Taint key (empty with Exists: all).")
    operator: str | None = Field(None, pattern=r"^(Exists|Equal)$", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value (Equal).")
    effect: str | None = Field(
        None,
        pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$",
        description="NoSchedule, PreferNoSchedule or NoExecute (empty: all).",
    )
    toleration_seconds: int | None = Field(None, description="NoExecute: how long the pod stays.")


class LocalObjectReference(ApiModel):
    """A Secret in the deployment's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")


_SPEC_RULES = cel(
    (
        "!has(self.securityContext)",
        _owned("the pod's securityContext", "non-root 65532, seccomp RuntimeDefault"),
    ),
    ("!has(self.initContainers)", _owned("initContainers", "libember's copy and the sidecar")),
    (
        "!has(self.automountServiceAccountToken) && !has(self.hostNetwork) && !has(self.hostPID) && "
        "!has(self.hostIPC)",
        _owned(
            "automountServiceAccountToken and host namespaces",
            "only the sidecar holds a token; no host access",
        ),
    ),
)


class PodSpecPatch(ApiModel):
    """Pod-level additions."""

    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)
    containers: list[ContainerPatch] = Field(
        default_factory=list, max_length=1, description="The engine container's additions."
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=_SHORT_LIST,
        description="Volumes (model cache PVC, /dev/shm …).",
        json_schema_extra=cel(
            (
                "self.all(v, !v.name.startsWith('ember-'))",
                _owned("volume names ember-*", "run directory, libember, token, store"),
            )
        ),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=_SHORT_LIST,
        description="Added to ember's nvidia.com/gpu toleration.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Pull secrets of the images."
    )
    service_account_name: Name | None = Field(
        None,
        description="The pods' ServiceAccount (workload identity). The sidecar reports with its "
        "token: bind the chart's ember-pod Role to it.",
    )
    priority_class_name: Name | None = Field(
        None,
        description="PriorityClass of serving pods (SAVE pods of "
        "alternatives keep the operator's presave class).",
    )
    node_selector: dict[Annotated[str, Field(max_length=316)], Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=MAX_MAP_ENTRIES,
        description="Added to ember's GPU product selector.",
        json_schema_extra=cel(
            (
                f"!('{contract.GPU_PRODUCT_NODE_LABEL}' in self)",
                f"nodeSelector {contract.GPU_PRODUCT_NODE_LABEL} is spec.gpu.product",
            )
        ),
    )
    affinity: Open | None = Field(
        None, description="Pod affinity and anti-affinity, node affinity.", json_schema_extra=OPEN
    )
    security_context: Open | None = Field(None, description="Refused: ember's.", json_schema_extra=OPEN)
    init_containers: list[Open] | None = Field(
        None, description="Refused: ember's.", json_schema_extra={"items": OPEN_OBJECT}
    )
    automount_service_account_token: bool | None = Field(None, description="Refused: ember's.")
    host_network: bool | None = Field(None, description="Refused.")
    host_pid: bool | None = Field(None, alias="hostPID", description="Refused.")
    host_ipc: bool | None = Field(None, alias="hostIPC", description="Refused.")


_OWN_KEYS = (
    f"!k.startsWith('{contract.GROUP}/') && k != '{contract.LABEL_MANAGED_BY}' && "
    f"k != '{contract.LABEL_COMPONENT}'"
)


class TemplateMeta(ApiModel):
    """Pod labels and annotations added to ember's."""

    labels: dict[str, MapValue] = Field(
        default_factory=dict,
        max_length=MAX_MAP_ENTRIES,
        description="Added pod labels.",
        json_schema_extra=cel(
            KEYS_RULE,
            (
                f"self.all(k, {_OWN_KEYS})",
                _owned(
                    f"labels {contract.GROUP}/*, {contract.LABEL_MANAGED_BY} and {contract.LABEL_COMPONENT}",
                    "pools, claims and the Service select by them",
                ),
            ),
        ),
    )
    annotations: dict[str, MapValue] = Field(
        default_factory=dict,
        max_length=MAX_MAP_ENTRIES,
        description="Added pod annotations.",
        json_schema_extra=cel(
            KEYS_RULE,
            (
                f"self.all(k, !k.startsWith('{contract.GROUP}/'))",
                _owned(f"annotations {contract.GROUP}/*", "the claim protocol"),
            ),
        ),
    )


class PodTemplatePatch(ApiModel):
    """Merged into every serving, warm and SAVE pod of the deployment: maps and lists are added to
    ember's (env by name: a variable replaces an ember default of that name), scalars set."""

    metadata: TemplateMeta = Field(default_factory=TemplateMeta, description="Labels and annotations.")
    spec: PodSpecPatch = Field(default_factory=PodSpecPatch, description="Pod spec additions.")

    def engine(self) -> ContainerPatch | None:
        return next((c for c in self.spec.containers if c.name == contract.ENGINE_CONTAINER), None)
