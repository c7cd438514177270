"""The `ember.dev/v1alpha1` API: typed models for ModelDeployment and GraphArchive.

This module is the ONE schema source. `crdgen` turns these models into the CRD YAML under
`crds/` and `charts/ember/files/crds/` (descriptions become `kubectl explain` text, `cel(...)` rules
become `x-kubernetes-validations`); the reconcilers parse objects into these models. Field names
are camelCase on the wire (Kubernetes convention) and snake_case in Python.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from ember.engines.transformers_cb.canary import IDENTITY_WORKLOAD as CB_IDENTITY_WORKLOAD
from ember.engines.vllm.args import IDENTITY_WORKLOAD, SLEEP_MODE_ARG, archived
from ember.identity import ArchiveIdentity, Parallelism
from ember.identity_args import graph_args, image_digest
from ember.serving.options import ServeOptions, UsageError, pod_options
from ember_operator.api_autoscaling import QUANTITY, AutoscalingSpec, MetricTarget  # noqa: F401
from ember_operator.api_base import (  # noqa: F401  (re-exported: crdgen and callers use api.*)
    DNS1123_SUBDOMAIN,
    KEYS_RULE,
    MAX_ARG,
    MAX_MAP_ENTRIES,
    MAX_MAP_VALUE,
    MAX_NAME,
    NO_SPACE,
    ApiModel,
    LabelValue,
    MapValue,
    cel,
)
from ember_operator.api_engine import ENGINE_VERSION, EngineKind, EngineResources, EngineSpec  # noqa: F401
from ember_operator.api_parallelism import (  # noqa: F401
    MAX_REPLICA_GPUS,
    ParallelismSpec,
    ParallelShape,
    ShapeSpec,
    ShapeStatus,
    SwitchStatus,
)
from ember_operator.api_signing import ArchiveSettings, SigningSpec, TrustedKey  # noqa: F401
from ember_operator.api_template import ContainerPatch, PodSpecPatch, PodTemplatePatch  # noqa: F401

# ------------------------------------------------------------------------------------------------
# ModelDeployment spec


class GraphMode(StrEnum):
    full = "full"
    piecewise = "piecewise"
    full_decode_only = "full-decode-only"
    full_and_piecewise = "full-and-piecewise"


class CapturePreset(StrEnum):
    default = "default"
    small = "small"
    powers_of_two = "powers-of-two"


# Identity strings reach SAVE Jobs, engine arguments and archive keys: a safe character set only.
# A path segment starts with a letter or digit (so never `..`), then letters, digits, `._-`.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MODEL_NAME = rf"^/?{_SEGMENT}(/{_SEGMENT})*$"  # a Hugging Face id (org/name) or an absolute path
REVISION = rf"^{_SEGMENT}(/{_SEGMENT})*$"  # a branch, tag (refs/pr/1) or commit


class Dtype(StrEnum):
    """The dtypes the engines accept (vLLM's --dtype choices)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    half = "half"
    float32 = "float32"
    float = "float"


class ModelRef(ApiModel):
    """Which weights to serve."""

    name: str = Field(
        description="Model name as the engine loads it, e.g. a Hugging Face id (Qwen/Qwen3-0.6B) or an "
        "absolute path in the image: letters, digits and ._- in '/'-separated segments that start with a "
        "letter or digit.",
        min_length=1, max_length=253, pattern=MODEL_NAME,
    )
    revision: str = Field(
        "main", description="Weights revision (branch, tag or commit); part of the archive identity. "
        "Letters, digits and ._- in '/'-separated segments that start with a letter or digit.",
        min_length=1, max_length=128, pattern=REVISION,
    )
    dtype: Dtype = Field(
        Dtype.bfloat16, description="Weights and activation dtype; part of the archive identity.",
    )


_SIZES_RULES = cel(
    (
        "!has(self.sizes) || !has(self.preset)",
        "capture: set either sizes or preset, not both",
    ),
    (
        "!has(self.sizes) || self.sizes.all(s, s > 0 && s <= self.maxBatch)",
        "capture.sizes must be positive and at most capture.maxBatch",
    ),
    ("!has(self.sizes) || self.sizes.isSorted()", "capture.sizes must be sorted ascending"),
    (
        "self.maxNumTokens >= self.maxBatch",
        "capture.maxNumTokens (token budget) must be at least capture.maxBatch",
    ),
)


class CaptureSpec(ApiModel):
    """Which CUDA graphs are captured (and saved, and restored). All of it is archive identity."""

    model_config = ConfigDict(json_schema_extra=_SIZES_RULES)
    sizes: list[int] | None = Field(
        None, min_length=1, max_length=512,
        description="Batch sizes to capture, sorted ascending, unique, each ≤ maxBatch. Excludes preset.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    preset: CapturePreset | None = Field(
        None,
        description="Named size list instead of sizes: default (vLLM's list up to maxBatch), small "
        "(1,2,4,8), powers-of-two (1,2,4,… up to maxBatch). Neither set means default.",
    )
    graph_mode: GraphMode = Field(GraphMode.full, description="CUDA graph mode (vLLM cudagraph_mode).")
    compile: dict[Annotated[str, Field(max_length=63)], MapValue] = Field(
        default_factory=dict, max_length=MAX_MAP_ENTRIES,
        description="Compile settings that change the captured kernels (e.g. level, backend, mode).",
    )
    max_num_tokens: int = Field(
        8192, ge=1, le=1 << 20, description="Token budget per engine step (chunked prefill bound)."
    )
    max_batch: int = Field(512, ge=1, le=8192, description="Largest batch a graph is captured for.")

    def resolved_sizes(self) -> tuple[int, ...]:
        if self.sizes:
            return tuple(self.sizes)
        preset = self.preset or CapturePreset.default
        cap = self.max_batch
        if preset is CapturePreset.small:
            return tuple(s for s in (1, 2, 4, 8) if s <= cap)
        if preset is CapturePreset.powers_of_two:
            out, s = [], 1
            while s <= cap:
                out.append(s)
                s *= 2
            return tuple(out)
        sizes = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
        return tuple(s for s in sizes if s <= cap)


class GpuSpec(ApiModel):
    """GPUs each replica runs on."""

    product: str = Field(
        description="GPU product as labelled by NVIDIA GPU feature discovery (node label "
        "nvidia.com/gpu.product), e.g. NVIDIA-H100-80GB-HBM3. Part of the archive identity.",
        min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
    )
    count: int | None = Field(None, ge=1, le=64, description="GPUs per replica (one pod): tensor × data "
                              "when unset; when set it must equal tensor × data.")


class S3Store(ApiModel):
    """An S3 (or S3-compatible) bucket."""

    bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$",
                        description="Bucket name (S3 rules: lower-case letters, digits, '.' and '-').")
    prefix: str = Field("ember", max_length=512, description="Key prefix under which archives live.")
    endpoint: str | None = Field(
        None, max_length=512, pattern=r"^https?://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?(/\S*)?$",
        description="Endpoint URL for S3-compatible stores (MinIO); AWS when unset.",
    )
    region: str | None = Field(None, max_length=64, description="Region name.")
    credentials_secret: str | None = Field(
        None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret in the same namespace with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
        "the standard boto3 credential chain when unset.",
    )


class LocalStore(ApiModel):
    """A directory (on a PersistentVolumeClaim in a cluster, or a plain path for development)."""

    path: str = Field(
        min_length=1, max_length=512, pattern=r"^/",
        description="Absolute directory path. Without a PVC the operator itself reads it, so it must "
        "lie under the operator's local store root (setting local_store_root).",
        json_schema_extra=cel(("!self.split('/').exists(p, p == '..')",
                               "store.local.path must not contain '..'")),
    )
    persistent_volume_claim: str | None = Field(
        None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="PVC mounted at path in SAVE Jobs and serving pods; no volume when unset.",
    )


def under_root(path: str, root: str) -> bool:
    """`path` is `root` or below it (both absolute; no '..' segments, which admission refuses)."""
    parts, base = [p for p in path.split("/") if p], [p for p in root.split("/") if p]
    return ".." not in parts and parts[: len(base)] == base


class StoreSpec(ApiModel):
    """Where archives are stored. Exactly one of s3 and local."""

    model_config = ConfigDict(
        json_schema_extra=cel((
            "has(self.s3) != has(self.local)", "store: set exactly one of s3 and local",
        ))
    )
    s3: S3Store | None = Field(None, description="S3 store.")
    local: LocalStore | None = Field(None, description="Local directory store.")

    def uri(self) -> str:
        if self.s3 is not None:
            prefix = self.s3.prefix.strip("/")
            return f"s3://{self.s3.bucket}/{prefix}" if prefix else f"s3://{self.s3.bucket}"
        if self.local is None:
            raise ValueError("store: set exactly one of s3 and local")
        return "file://" + self.local.path.rstrip("/")

    @classmethod
    def from_uri(cls, uri: str, endpoint: str = "") -> StoreSpec:
        """The operator's default store (a URI) as a spec: s3://bucket/prefix or file:///path."""
        if uri.startswith("s3://"):
            bucket, _, prefix = uri[len("s3://"):].partition("/")
            return cls(s3=S3Store(bucket=bucket, prefix=prefix, endpoint=endpoint or None))
        if uri.startswith("file://"):
            return cls(local=LocalStore(path=uri[len("file://"):]))
        if uri.startswith("/"):
            return cls(local=LocalStore(path=uri))
        raise ValueError(f"store URI must be s3://bucket/prefix or file:///path, got {uri!r}")

    @property
    def credentials_secret(self) -> str | None:
        return self.s3.credentials_secret if self.s3 else None


class WarmEngine(StrEnum):
    """How the engine of an identity-keyed warm pod idles until its claim (ember.contract)."""

    ready = "ready"
    sleeping = "sleeping"




class WarmPoolSpec(ApiModel):
    """Pre-warmed pods: per deployment, shape and archive once the shape's archive is Available
    (engine loaded before the claim), else per (GPU product, GPU count, engine, store)."""

    size: int = Field(0, ge=0, le=256, description="GPUs to keep warm in unclaimed pods: pods of the current "
                      "shape's GPU count and of each alternative's, round robin, while they fit (a 1-GPU "
                      "deployment keeps this many pods). A pool's size is the largest ask of the "
                      "deployments sharing it.")
    engine: WarmEngine = Field(
        WarmEngine.ready, description="How the engine of a warm pod (of a shape whose archive is "
        "Available) idles until its claim. ready: restored, one token run, weights and KV cache on "
        "the GPU; the claim is served at once. sleeping (vLLM only): the same, then vLLM's sleep mode "
        "level 1 frees the KV cache and moves the weights to host memory (the engine container's "
        "memory must hold them); the claim wakes it first. vLLM then runs with --enable-sleep-mode "
        "(part of the archive identity: a change saves a new archive) and, on warm pods, its "
        "development endpoints on (VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /collective_rpc …) for "
        "the pod's life. A change replaces the warm pods.",
    )


class SaveOptions(ApiModel):
    """SAVE Job options of a ModelDeployment (the first deployment of an identity sets them)."""

    pod_annotations: dict[str, MapValue] = Field(
        default_factory=dict, max_length=MAX_MAP_ENTRIES,
        description="Extra annotations on the SAVE pod (e.g. for a mesh or autoscaler).",
        json_schema_extra=cel(KEYS_RULE),
    )
    timeout_seconds: int | None = Field(
        None, ge=60, le=86400,
        description="activeDeadlineSeconds of the SAVE Job (operator default when unset).",
    )


SLEEPING_NEEDS_VLLM = (
    "warmPool.engine sleeping needs engine.kind vllm (its sleep mode frees the KV cache); the "
    "transformers engine's restored graphs point at its KV cache, so its warm pods always hold it: use ready"
)
_MD_SPEC_RULES = cel(
    (
        "!has(self.gpu.count) || self.gpu.count == self.parallelism.tensor * self.parallelism.data",
        "gpu.count must equal parallelism.tensor × parallelism.data (or be left unset)",
    ),
    (
        "self.warmPool.engine != 'sleeping' || self.engine.kind == 'vllm'",
        SLEEPING_NEEDS_VLLM,
    ),
    (
        "!has(self.autoscaling) || self.replicas > 0",
        "replicas 0 turns the HPA off (Kubernetes does not autoscale a target scaled to zero): "
        "remove autoscaling to scale to zero, or set replicas ≥ autoscaling.minReplicas",
    ),
)


class ModelDeploymentSpec(ApiModel):
    """Desired state of a ModelDeployment."""

    model_config = ConfigDict(json_schema_extra=_MD_SPEC_RULES)
    model: ModelRef = Field(description="The model to serve.")
    engine: EngineSpec = Field(description="The serving engine.")
    capture: CaptureSpec = Field(default_factory=CaptureSpec, description="CUDA graph capture settings.")
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, description="Parallel degrees per replica. An edit switches the "
        "pods to the new shape (new pods Ready first, then the old ones drain): at once when the shape "
        "is one of the alternatives with its archive saved, after a SAVE otherwise.",
    )
    gpu: GpuSpec = Field(description="GPU product and count per replica.")
    replicas: int = Field(1, ge=0, le=10000, description="Serving replicas (the /scale subresource).")
    warm_pool: WarmPoolSpec = Field(default_factory=WarmPoolSpec, description="Warm pool.")
    store: StoreSpec | None = Field(
        None, description="Archive store; the operator's default store (chart value) when unset."
    )
    autoscaling: AutoscalingSpec | None = Field(None, description="HPA bounds and targets.")
    save: SaveOptions = Field(default_factory=SaveOptions, description="SAVE Job options.")
    archive: ArchiveSettings = Field(default_factory=ArchiveSettings,
                                     description="Archive signing and the keys serving pods trust.")
    template: PodTemplatePatch | None = Field(None, description="Pod template patch for the serving, warm "
                                              "and SAVE pods (env, volumes, tolerations, service account …).")

    drain_seconds: int = Field(
        10, ge=0, le=3600, description="When pods of an old shape or revision go: seconds between "
        "taking them out of service (readiness off, out of the Service and the HPA's count) and "
        "deleting them, for requests in flight.",
    )

    @model_validator(mode="after")
    def _checks(self) -> ModelDeploymentSpec:
        # The operator's own check of objects stored before admission had the rule, and of what
        # CEL cannot judge (engine.args as `ember serve` parses them).
        if self.gpu.count is not None and self.gpu.count != self.gpu_count():
            raise ValueError(f"gpu.count {self.gpu.count} must equal parallelism.tensor × parallelism.data "
                             f"({self.gpu_count()}), or be left unset")
        if self.warm_pool.engine == WarmEngine.sleeping and self.engine.kind != EngineKind.vllm:
            raise ValueError(SLEEPING_NEEDS_VLLM)
        if self.engine.kind == EngineKind.transformers:
            try:
                self.serve_options()
            except UsageError as exc:
                raise ValueError(f"engine.args: {exc} (engine.kind transformers: its pods and its SAVE "
                                 "Job run `ember serve` with them)") from None
        return self

    def serve_options(self) -> ServeOptions:
        """transformers: the options of the pods' and the SAVE Job's `ember serve` (the model, then
        `engine.args`); UsageError with what `ember serve` would refuse or a pod's command owns."""
        return pod_options(self.model.name, self.engine_run_args())

    def engine_run_args(self) -> list[str]:
        """The engine's arguments as every process of the deployment runs them (SAVE Job, serving
        and warm pods): `engine.args`, and for `warmPool.engine: sleeping` vLLM's sleep mode, which
        allocates the weights and the KV cache through another allocator (other addresses, so the
        archive must be saved with it: it is part of the identity like any graph argument)."""
        args = list(self.engine.args)
        if self.warm_pool.engine == WarmEngine.sleeping and SLEEP_MODE_ARG not in args:
            args.append(SLEEP_MODE_ARG)
        return args

    def gpu_count(self, shape: ShapeSpec | None = None) -> int:
        """GPUs of one replica of `shape` (the current one by default)."""
        return (shape or self.parallelism).gpus

    def identity(self, shape: ShapeSpec | None = None) -> ArchiveIdentity:
        """The archive identity: what a SAVE of this spec (in `shape`, by default the current one)
        captures; its hash names the GraphArchive. vLLM's data parallel replicas of a dense model
        are engines of their own: their shape's archive is data 1's (`archived`)."""
        shape = shape or self.parallelism
        par = Parallelism(tensor=shape.tensor, expert=shape.expert, data=shape.data)
        vllm = self.engine.kind == EngineKind.vllm
        return ArchiveIdentity(
            model=self.model.name,
            revision=self.model.revision,
            engine=self.engine.kind.value,
            engine_version=self.engine.version,
            capture_sizes=self.capture.resolved_sizes(),
            graph_mode=self.capture.graph_mode.value,
            compile=dict(sorted(self.capture.compile.items())),
            dtype=self.model.dtype.value,
            max_num_tokens=self.capture.max_num_tokens,
            max_batch=self.capture.max_batch,
            parallelism=archived(par) if vllm else par,
            gpu_product=self.gpu.product,
            engine_args=graph_args(self.engine_run_args()),
            image_digest=image_digest(self.engine.image),
            workload=dict(IDENTITY_WORKLOAD if vllm else CB_IDENTITY_WORKLOAD),
        )


# ------------------------------------------------------------------------------------------------
# Status (shared)


class ConditionStatus(StrEnum):
    true = "True"
    false = "False"
    unknown = "Unknown"


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type (PascalCase).", max_length=316)
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field("", max_length=1024, description="One-word CamelCase reason.")
    message: str = Field("", max_length=32768, description="Human-readable details.")
    observed_generation: int | None = Field(None, ge=0, description="Generation the condition is about.")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339).")


_CONDITIONS_EXTRA: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class MDPhase(StrEnum):
    pending = "Pending"
    saving = "Saving"
    deploying = "Deploying"
    ready = "Ready"
    scaling = "Scaling"
    reconfiguring = "Reconfiguring"
    switching = "Switching"
    degraded = "Degraded"
    invalid = "Invalid"  # the operator refuses the spec (Progressing=False says why); nothing is done


class ArchiveRef(ApiModel):
    """The archive the deployment's new pods restore from."""

    name: str = Field(description="GraphArchive name.")
    identity_hash: str = Field(description="Archive identity hash.")
    uri: str | None = Field(None, description="Manifest URI (set once the archive is available).")
    phase: str | None = Field(None, description="The GraphArchive's phase.")


class ModelDeploymentStatus(ApiModel):
    """Observed state of a ModelDeployment. `phase` summarizes the conditions."""

    phase: MDPhase | None = Field(None, description="Summary: Pending, Saving, Deploying, Ready, "
                                  "Scaling, Reconfiguring, Switching, Degraded or Invalid.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready (True exactly when phase is Ready), ArchiveReady, "
        "Available, Progressing, Schedulable; each with observedGeneration.",
        json_schema_extra=_CONDITIONS_EXTRA,
    )
    observed_generation: int | None = Field(None, description="Generation last reconciled.")
    replicas: int = Field(0, description="Serving pods (all revisions).")
    ready_replicas: int = Field(0, description="Ready serving pods.")
    updated_replicas: int = Field(0, description="Serving pods of the current revision.")
    restored_replicas: int = Field(0, description="Pods whose sidecar reported ember.dev/restore=restored.")
    selector: str | None = Field(None, description="Label selector of the serving pods (for HPA).")
    address: str | None = Field(None, description="The deployment's Service: <name>.<namespace>.svc:<port>, "
                                "routing to its Ready serving pods.")
    revision: str | None = Field(None, description="Current pod revision hash.")
    archive: ArchiveRef | None = Field(None, description="The archive in use.")
    last_restore_time: str | None = Field(None, description="Most recent successful restore (RFC 3339).")
    fallback_count: int = Field(0, description="Pods that fell back to native capture.")
    native_replicas: int = Field(0, description="Serving pods claimed without an archive (native capture); "
                                 "replaced by restoring pods once the archive is Available.")
    warm_claims: int = Field(0, description="Warm pods claimed by this deployment (lifetime count).")
    warm_ready: int = Field(0, description="Its identity-keyed warm pods whose engine is loaded and idle "
                            "(ember.dev/engine=ready): claimable.")
    warm_loading: int = Field(0, description="Its identity-keyed warm pods whose engine is still loading "
                              "(not claimable yet).")
    shapes: list[ShapeStatus] = Field(default_factory=list, description="The current shape and each "
                                      "alternative of spec.parallelism, with its archive's phase.")
    switch: SwitchStatus | None = Field(None, description="A switch between shapes in progress.")


# ------------------------------------------------------------------------------------------------
# GraphArchive


class IdentitySpec(ApiModel):
    """The archive identity (mirror of ember.identity.ArchiveIdentity, camelCase)."""

    model: str = Field(description="Model name.")
    revision: str = Field("main", description="Weights revision.")
    engine: str = Field(description="Engine kind.")
    engine_version: str = Field(description="Engine version.")
    capture_sizes: list[int] = Field(description="Captured batch sizes.")
    graph_mode: str = Field("full", description="CUDA graph mode.")
    compile: dict[str, str] = Field(default_factory=dict, description="Compile settings.")
    dtype: str = Field("bfloat16", description="dtype.")
    max_num_tokens: int = Field(8192, description="Token budget.")
    max_batch: int = Field(512, description="Largest captured batch.")
    parallelism: ShapeSpec = Field(default_factory=ShapeSpec, description="Parallel degrees.")
    gpu_product: str = Field("", description="GPU product the archive is saved on.")
    engine_args: list[str] = Field(default_factory=list, description="Engine arguments that change graphs.")
    image_digest: str = Field("", description="Engine image digest (sha256:…) when the image is pinned.")
    workload: dict[str, str] = Field(default_factory=dict, description="How ember runs the engine beyond "
                                     "the fields above, where it shapes the graphs (vLLM: Inductor's mode) "
                                     "or what LOAD checks (every engine: its canary's kind).")

    @classmethod
    def of(cls, ident: ArchiveIdentity) -> IdentitySpec:
        return cls.model_validate(ident.model_dump(mode="json"))

    def to_identity(self) -> ArchiveIdentity:
        data = self.model_dump(mode="json")
        data["capture_sizes"] = tuple(data["capture_sizes"])
        data["engine_args"] = tuple(data["engine_args"])
        return ArchiveIdentity.model_validate(data)


class SaveSpec(ApiModel):
    """How the SAVE Job runs."""

    image: str = Field(description="Engine image that runs `ember save --job`.")
    args: list[str] = Field(default_factory=list, description="Engine arguments for the SAVE run.")
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations on the SAVE pod."
    )
    timeout_seconds: int | None = Field(
        None, ge=60, description="activeDeadlineSeconds of the SAVE Job (operator default when unset)."
    )
    signing_secret: str | None = Field(
        None, description="Secret with the PEM ed25519 signing key ('signing-key.pem'), mounted into "
        "the SAVE Job; the archive is unsigned when unset.",
    )
    priority_class_name: str | None = Field(
        None, description="priorityClassName of the SAVE pod (archives saved ahead of time for "
        "spec.parallelism.alternatives run at the operator's low presave priority).",
    )
    resources: EngineResources = Field(default_factory=EngineResources,
                                       description="Requests and limits of the SAVE container (+ 1 GPU).")
    template: PodTemplatePatch | None = Field(None, description="The deployment's pod template patch.")


class GraphArchiveSpec(ApiModel):
    """One archive identity; shared by every ModelDeployment of the namespace with that identity."""

    identity_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="sha256 of the canonical identity JSON.",
        json_schema_extra=cel(("self == oldSelf", "identityHash is immutable")),
    )
    identity: IdentitySpec = Field(description="What the archive captures.")
    store: StoreSpec = Field(description="Where the archive is (or will be) stored.")
    save: SaveSpec = Field(description="SAVE Job settings.")


class GAPhase(StrEnum):
    pending = "Pending"
    saving = "Saving"
    available = "Available"
    failed = "Failed"


class CompatKeySummary(ApiModel):
    """Where the archive can be LOADed (from the manifest)."""

    gpu_name: str | None = None
    compute_capability: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    engine: str | None = None


class GraphArchiveStatus(ApiModel):
    """Observed state of a GraphArchive."""

    phase: GAPhase | None = Field(None, description="Pending, Saving, Available or Failed.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Saved (the manifest exists in the store).",
        json_schema_extra=_CONDITIONS_EXTRA,
    )
    observed_generation: int | None = Field(None, description="Generation last reconciled.")
    uri: str | None = Field(None, description="Manifest URI in the store.")
    bytes: int | None = Field(None, description="Stored bytes of the archive's blobs.")
    digest: str | None = Field(None, description="sha256 of the manifest.")
    graphs: int | None = Field(None, description="Graphs in the archive.")
    compat_key: CompatKeySummary | None = Field(None, description="Compatibility key.")
    save_job: str | None = Field(None, description="Name of the current SAVE Job.")
    attempt: int = Field(0, description="SAVE attempt number (0 first).")
    durations: dict[str, float] = Field(default_factory=dict, description="SAVE stage durations, seconds.")
    failure_reason: str | None = Field(None, description="Why the last SAVE failed.")
    next_retry_time: str | None = Field(None, description="When the next SAVE attempt may start.")
    save_started_time: str | None = Field(None, description="When the current SAVE Job was created.")
    completion_time: str | None = Field(None, description="When the archive became available.")
    unreferenced_since: str | None = Field(
        None, description="When the last ModelDeployment or pod stopped using it (GC clock)."
    )
