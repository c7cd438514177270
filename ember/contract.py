"""The pod contract: every name the operator, the sidecar and the engine-side runtime share.

One module, so the three sides cannot drift apart. The operator (``ember_operator``) writes these
labels, annotations, environment variables, mounts and ports onto serving pods, warm pods and SAVE
Jobs; the sidecar (``ember_sidecar``) and the engine process (``ember.handoff``, ``ember.runtime``,
``ember.engines``, ``ember.serving``) read them. Plain constants and two small dataclasses
(``Claim``, ``SaveResult``) with their wire formats; no Kubernetes or S3 client is imported here.

A pod's life, in contract terms::

    warm pod     labels {LABEL_POOL: POOL_WARM, LABEL_POOL_KEY: ...}; identity-keyed (bound) warm
                 pods also LABEL_WARM_FOR and Claim.annotations() without ANN_CLAIMED_AT from their
                 creation (the sidecar hands the archive off at once, the engine LOADs, then
                 writes ENGINE_STATE_FILE; the sidecar mirrors it as ANN_ENGINE); template-keyed
                 warm pods carry ANN_PREFETCH (JSON list) and learn their archive with the claim
                 (vLLM also its model; transformers pods run theirs from creation: serve_args)
    claim        Claim.labels() + Claim.annotations() patched onto it (or a cold pod created so);
                 on a bound pod only the labels (into service) and ANN_CLAIMED_AT change
    sidecar      Claim.from_annotations(...) → fetch, verify → RUN_DIR/STATUS_FILE (ember.handoff)
    engine       waits on RUN_DIR, LOADs or captures natively, reports into RUN_DIR/REPORTS_DIR
    result       the sidecar annotates ANN_RESTORE = RESTORED | FALLBACK_PREFIX + reason

A SAVE Job runs ``ember save --job`` with ENV_IDENTITY and ENV_STORE and reports through its
termination message (``write_termination_log`` writes it, ``SaveResult.from_termination`` reads it).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.identity import identity_short

# ---- API group (the CRDs) ------------------------------------------------------------------------
GROUP = "ember.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND_MODEL_DEPLOYMENT = "ModelDeployment"
KIND_GRAPH_ARCHIVE = "GraphArchive"
MODEL_DEPLOYMENTS = "modeldeployments"  # plural (API paths)
GRAPH_ARCHIVES = "grapharchives"

_P = f"{GROUP}/"  # prefix of every label and annotation key below

# ---- Labels (pods, SAVE Jobs, GraphArchives, HPAs) -----------------------------------------------
LABEL_POOL = _P + "pool"  # POOL_WARM | POOL_SERVING | POOL_DRAINING
LABEL_DEPLOYMENT = _P + "deployment"  # serving pods: their ModelDeployment (the sidecar reads it)
LABEL_GPU_PRODUCT = _P + "gpu-product"
LABEL_POOL_KEY = _P + "pool-key"  # hash of the pod template: pods of equal templates share a pool
LABEL_IDENTITY = _P + "identity"  # the identity hash's first 16 hex (a label value is short)
LABEL_REVISION = _P + "revision"
LABEL_ARCHIVE = _P + "archive"  # SAVE Jobs and their pods: the GraphArchive's name
# Identity-keyed warm pods: the ModelDeployment they were made for (no LABEL_DEPLOYMENT until the
# claim, so no Service, InferencePool or HPA selector matches them while they are warm).
LABEL_WARM_FOR = _P + "warm-for"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY_OPERATOR = "ember-operator"
POOL_WARM = "warm"
POOL_SERVING = "serving"
POOL_DRAINING = "draining"  # out of service (old shape or revision): deleted after a grace period

# ---- Annotations ---------------------------------------------------------------------------------
# The claim (written by the operator, read by the sidecar; see `Claim`). ANN_IDENTITY and ANN_ARCHIVE
# share their keys with LABEL_IDENTITY and LABEL_ARCHIVE: annotations carry the full values.
ANN_ARCHIVE = _P + "archive"  # manifest URI (…/archives/<hash>/manifest); "" → native capture
ANN_IDENTITY = _P + "identity"  # the full identity hash
ANN_IDENTITY_SPEC = _P + "identity-spec"  # canonical identity JSON (model, capture, ...)
ANN_ENGINE_ARGS = _P + "engine-args"  # JSON list of extra engine arguments
ANN_RANK = _P + "rank"  # this pod's rank ...
ANN_WORLD = _P + "world"  # ... of this many: a pod of N GPUs is rank 0 of world N (its ranks 0..N-1)
ANN_CLAIMED_AT = _P + "claimed-at"  # RFC 3339 with fractional seconds (or epoch seconds)
ANN_NATIVE_REASON = _P + "native-reason"  # claims without an archive: why (capture natively)
# sha256 of the manifest the operator saw Available: the sidecar refuses a manifest with another
# digest (a replaced or swapped archive). Required on every claim that names an archive.
ANN_MANIFEST_DIGEST = _P + "manifest-digest"
# Warm pods: manifest URIs to cache before any claim (JSON list; comma/space separated accepted).
ANN_PREFETCH = _P + "prefetch"
# Written by the sidecar once per claim: RESTORED or FALLBACK_PREFIX + reason, and when.
ANN_RESTORE = _P + "restore"
ANN_RESTORE_TIME = _P + "restore-time"  # RFC 3339, optional
# Written by the sidecar from the engine's state (ENGINE_STATE_FILE, or the engine's `ready`
# report): ENGINE_LOADING | ENGINE_READY | ENGINE_FAILED_PREFIX + reason. The operator claims an
# identity-keyed warm pod only when it says ENGINE_READY, and replaces one that says failed.
ANN_ENGINE = _P + "engine"
ENGINE_LOADING = "loading"
ENGINE_READY = "ready"  # loaded (weights, graphs, KV cache) and idle: answers at once when claimed
ENGINE_FAILED = "failed"
ENGINE_FAILED_PREFIX = f"{ENGINE_FAILED}: "
RESTORED = "restored"
FALLBACK = "fallback"
FALLBACK_PREFIX = f"{FALLBACK}: "


def reason_class(reason: str) -> str:
    """The metric label of a fallback reason (what follows FALLBACK_PREFIX): its head before ':',
    bounded in length and alphabet (the sidecar's `ember_restores_total{reason}` and the operator's
    `ember_restore_fallbacks_total{reason}`)."""
    head = reason.split(":", 1)[0].strip().lower()
    head = re.sub(r"[^a-z0-9-]+", "-", head).strip("-")
    return head[:48] or "unknown"


def engine_annotation(state: str, reason: str = "") -> str:
    """ANN_ENGINE's value for an engine state (ENGINE_STATE_FILE's "state"); "" for an unknown
    state (nothing to say)."""
    if state == ENGINE_FAILED:
        return ENGINE_FAILED_PREFIX + ((reason or "unknown").strip()[:512] or "unknown")
    return state if state in (ENGINE_LOADING, ENGINE_READY) else ""


def event_name(regarding: str, *what: str) -> str:
    """A deterministic Event name: the regarded object's name and a hash of what the event says
    (its uid, type, reason, message). The same event posted twice (a retried reconcile, a
    restarted process) collides on the name (409) and becomes a series (count, last seen) on the
    first one instead of a second object."""
    digest = hashlib.sha256("\0".join(what).encode()).hexdigest()[:16]
    return f"{regarding[:200]}.{digest}"


# Set by the operator when it takes a serving pod out of service (RFC 3339): the sidecar's readiness
# turns off at once; the pod is deleted `spec.drainSeconds` later (requests in flight finish).
ANN_DRAIN = _P + "drain-at"
# SAVE Jobs: the attempt number (a retry is a new Job).
ANN_SAVE_ATTEMPT = _P + "attempt"

FINALIZER = _P + "cleanup"  # on ModelDeployments: the operator's cleanup runs before deletion
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_NODE_LABEL = "nvidia.com/gpu.product"

# ---- Files and directories in a pod --------------------------------------------------------------
# The run directory: an emptyDir shared by the engine and the sidecar (outlives container
# restarts, not the pod). The same default everywhere, in a pod and outside one.
RUN_DIR = "/var/run/ember"
STATUS_FILE = "status.json"  # the sidecar's handoff state (ember.handoff), atomic replace
MARKER_FILE = "load-attempt.json"  # crash marker: present while the engine LOADs
REPORTS_DIR = "reports"  # the engine's stage reports, one file each
CACHE_DIR = "store"  # verified archives: a local store (blobs/, archives/<hash>/manifest)
SIDECAR_PORT_FILE = "sidecar.port"  # the port the sidecar bound (scripts start it with port 0)
# The engine's own state, written by the engine side (ember.handoff.write_engine_state), read by the
# sidecar: {"state": ENGINE_LOADING | ENGINE_READY | ENGINE_FAILED, "reason", "identity", "pid", "at"}.
ENGINE_STATE_FILE = "engine-state.json"

PODINFO_DIR = "/etc/ember/podinfo"  # downward API: files `labels` and `annotations`, updated live
LIB_NAME = "libember.so"
LIB_DIR = "/opt/ember/lib"  # in the ember image, and where the engine container mounts it
LIB_PATH = f"{LIB_DIR}/{LIB_NAME}"
TERMINATION_LOG = "/dev/termination-log"  # the SAVE container's terminationMessagePath
TERMINATION_LIMIT = 4000  # characters written (Kubernetes keeps 4096 bytes)

# ---- Containers and ports ------------------------------------------------------------------------
ENGINE_CONTAINER = "engine"
SIDECAR_CONTAINER = "ember-sidecar"
LIB_CONTAINER = "ember-lib"  # init container copying libember.so into the pod
SAVE_CONTAINER = "save"
SIDECAR_PORT = 9400  # the sidecar's HTTP: READYZ, LIVEZ, METRICS
ENGINE_PORT = 8000  # `ember serve` (OpenAI-style HTTP)
READYZ, LIVEZ, METRICS = "/readyz", "/livez", "/metrics"

# ---- Environment variables -----------------------------------------------------------------------
# Set by the operator on the engine and sidecar containers of every pod:
ENV_RUN_DIR = "EMBER_RUN_DIR"  # → RUN_DIR (ember.handoff.run_dir_from_env and the sidecar read it)
ENV_PODINFO_DIR = "EMBER_PODINFO_DIR"  # → PODINFO_DIR
ENV_POD_NAME = "POD_NAME"  # downward API (the sidecar also accepts EMBER_POD_NAME)
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_UID = "POD_UID"
# Engine container (and the SAVE container):
ENV_LIB = "EMBER_LIB"  # → LIB_PATH (ember.native finds libember.so through it)
ENV_ENGINE = "EMBER_ENGINE"  # the engine kind of the ModelDeployment
# Identity-keyed warm pods: how the engine idles before the claim (ModelDeployment
# spec.warmPool.engine). WARM_ENGINE_READY holds everything (weights, graphs, KV cache) and answers
# at once; WARM_ENGINE_SLEEPING (vLLM only: sleep mode level 1) frees the KV cache and moves the
# weights to host memory until the claim wakes it. Unset: ready.
ENV_WARM_ENGINE = "EMBER_WARM_ENGINE"
WARM_ENGINE_READY = "ready"
WARM_ENGINE_SLEEPING = "sleeping"
# Sidecar and SAVE containers: the store (ember.store reads ENV_S3_ENDPOINT itself too).
ENV_STORE = "EMBER_STORE"
ENV_S3_ENDPOINT = "EMBER_S3_ENDPOINT"
ENV_SIDECAR_PORT = "EMBER_SIDECAR_PORT"  # → SIDECAR_PORT
# SAVE Jobs (`ember save --job`):
ENV_IDENTITY = "EMBER_IDENTITY"  # canonical identity JSON
ENV_IDENTITY_HASH = "EMBER_IDENTITY_HASH"
ENV_TERMINATION_LOG = "EMBER_TERMINATION_LOG"  # overrides TERMINATION_LOG (tests, local runs)
# Archive signatures (ember.archive.signing). SAVE: the PEM ed25519 private key's path (the
# operator mounts the signing Secret's SIGNING_SECRET_KEY at SIGNING_KEY_DIR). Sidecar and engine:
# the public keys the deployment trusts, a JSON list of {"id", "publicKey"}; set → an unsigned or
# wrongly signed archive is refused (native capture), unset → signatures are not checked.
ENV_SIGNING_KEY = "EMBER_SIGNING_KEY"
ENV_TRUSTED_KEYS = "EMBER_TRUSTED_KEYS"
SIGNING_KEY_DIR = "/etc/ember/signing"
SIGNING_SECRET_KEY = "signing-key.pem"  # the key in the signing Secret's data
SIGNING_KEY_PATH = f"{SIGNING_KEY_DIR}/{SIGNING_SECRET_KEY}"


# ---- The transformers engine's arguments ---------------------------------------------------------
# A transformers deployment's pods run `ember serve --run-dir RUN_DIR --host 0.0.0.0 --port
# ENGINE_PORT <serve_args>` (the operator writes the command; its claims carry serve_args), and its
# SAVE Job reads the same serve_args: one model, one sizing on both sides.
SERVE_MODEL_OPTIONS = ("--model", "--model-config")


def serve_model_args(model: str, engine_args: Sequence[str]) -> list[str]:
    """A transformers deployment's model options: `--model <model>` (its `model.name`) unless its
    `engine_args` name the model themselves (`--model NAME|DIR`, `--model-config FILE`)."""
    named = any(a.split("=", 1)[0] in SERVE_MODEL_OPTIONS for a in engine_args)
    return [] if named else ["--model", model]


def serve_args(model: str, engine_args: Sequence[str]) -> list[str]:
    """A transformers deployment's `ember serve` arguments after the pod's own: the model options,
    then `engine_args`."""
    return [*serve_model_args(model, engine_args), *engine_args]


# ---- The claim -----------------------------------------------------------------------------------


class ClaimError(ValueError):
    """Claim annotations are present but malformed (for the sidecar: a fallback reason)."""


@dataclass(frozen=True)
class Claim:
    """What a claim writes onto a pod: the operator serialises it, the sidecar parses it back.

    `archive_uri` "" means native capture (`native_reason` says why); otherwise `manifest_digest`
    pins the manifest's sha256 (the sidecar refuses any other). `rank`/`world` are the
    multi-GPU layout (0 of 1 today). `deployment` and `revision` travel as labels, the rest as
    annotations. Two claims with the same `key` are the same restore (watch events repeat).
    """

    archive_uri: str
    identity: str  # the full identity hash
    rank: int = 0
    world: int = 1
    claimed_at: float | None = None  # epoch seconds, the operator's clock
    deployment: str = ""
    revision: str = ""
    identity_spec: str = ""  # canonical identity JSON
    engine_args: tuple[str, ...] = ()
    native_reason: str = ""
    manifest_digest: str = ""  # sha256 hex of the manifest bytes

    @property
    def key(self) -> tuple[str, str, int, int, str]:
        return (self.archive_uri, self.identity, self.rank, self.world, self.manifest_digest)

    @property
    def native(self) -> bool:
        """No archive: the engine captures natively."""
        return not self.archive_uri

    def labels(self) -> dict[str, str]:
        return {
            LABEL_POOL: POOL_SERVING,
            LABEL_DEPLOYMENT: self.deployment,
            LABEL_IDENTITY: identity_short(self.identity),
            LABEL_REVISION: self.revision,
        }

    def annotations(self) -> dict[str, str]:
        out = {
            ANN_ARCHIVE: self.archive_uri,
            ANN_IDENTITY: self.identity,
            ANN_IDENTITY_SPEC: self.identity_spec,
            ANN_ENGINE_ARGS: json.dumps(list(self.engine_args)),
            ANN_RANK: str(self.rank),
            ANN_WORLD: str(self.world),
        }
        if self.claimed_at is not None:
            out[ANN_CLAIMED_AT] = format_claimed_at(self.claimed_at)
        if self.native:
            out[ANN_NATIVE_REASON] = self.native_reason or "NoArchive"
        else:
            out[ANN_MANIFEST_DIGEST] = self.manifest_digest
        return out

    @classmethod
    def from_annotations(
        cls, annotations: dict[str, str] | None, labels: dict[str, str] | None = None
    ) -> Claim | None:
        """The claim on a pod; None when it carries none (a warm pod).

        Raises ClaimError for a rank or world that is not an integer. Only decodes: whether the
        claim is restorable (manifest URI, identity, layout) is the sidecar's call.
        """
        ann, lab = annotations or {}, labels or {}
        archive = (ann.get(ANN_ARCHIVE) or "").strip()
        identity = (ann.get(ANN_IDENTITY) or "").strip()
        if not archive and not identity:
            return None
        return cls(
            archive_uri=archive, identity=identity,
            rank=_int(ann, ANN_RANK, 0), world=_int(ann, ANN_WORLD, 1),
            claimed_at=parse_claimed_at(ann.get(ANN_CLAIMED_AT)),
            deployment=lab.get(LABEL_DEPLOYMENT, ""), revision=lab.get(LABEL_REVISION, ""),
            identity_spec=ann.get(ANN_IDENTITY_SPEC, ""),
            engine_args=_engine_args(ann.get(ANN_ENGINE_ARGS)),
            native_reason=(ann.get(ANN_NATIVE_REASON) or "").strip(),
            manifest_digest=(ann.get(ANN_MANIFEST_DIGEST) or "").strip().lower(),
        )


def _int(annotations: dict[str, str], key: str, default: int) -> int:
    raw = annotations.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ClaimError(f"annotation {key}={raw!r} is not an integer") from None


def _engine_args(raw: str | None) -> tuple[str, ...]:
    """The engine arguments; unreadable ones decode as none (the sidecar does not use them)."""
    try:
        items = json.loads(raw or "[]")
    except ValueError:
        return ()
    return tuple(str(i) for i in items) if isinstance(items, list) else ()


def format_claimed_at(epoch: float) -> str:
    """RFC 3339 in UTC with microseconds (the sidecar times sub-second stages from it)."""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_claimed_at(raw: str | None) -> float | None:
    """Epoch seconds of a claim stamp: a float, or RFC 3339 WITH fractional seconds.

    A whole-second RFC 3339 stamp is too coarse to time a sub-second stage, so it is ignored
    (claim→fetch is then measured from the watch event). Informative only: never fails a claim.
    """
    raw = (raw or "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    if "." not in raw:
        return None
    try:
        stamp = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def prefetch_annotation(uris: list[str]) -> str:
    """ANN_PREFETCH's value: the distinct manifest URIs, sorted, as a JSON list."""
    return json.dumps(sorted(set(uris)))


def parse_prefetch(raw: str | None) -> list[str]:
    """ANN_PREFETCH's entries as written (a JSON list, or comma/whitespace separated), in order;
    an unreadable value is empty. The reader checks that each is a manifest URI."""
    raw = (raw or "").strip()
    if not raw:
        return []
    items: Any
    if raw.startswith("["):
        try:
            items = json.loads(raw)
        except ValueError:
            return []
        if not isinstance(items, list):
            return []
    else:
        items = re.split(r"[,\s]+", raw)
    return [i.strip() for i in items if isinstance(i, str) and i.strip()]


# ---- The SAVE Job's result -----------------------------------------------------------------------


@dataclass
class SaveResult:
    """The SAVE container's outcome as the operator reads it from the pod status.

    On success the container writes a JSON summary to its termination message; the operator
    uses `manifest_digest`, `bytes`, `graphs` and `durations` (stage → seconds) from it. On
    failure it writes the reason (plain text, or a summary with a `reason` key).
    """

    succeeded: bool
    message: str = ""
    manifest_digest: str | None = None
    bytes: int | None = None
    graphs: int | None = None
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """The failure reason: the message's last line, at most 512 characters."""
        return self.message.strip().splitlines()[-1][:512] if self.message.strip() else ""

    @classmethod
    def from_termination(cls, exit_code: int | None, message: str) -> SaveResult:
        """Parse a terminated SAVE container's exit code and termination message."""
        result = cls(succeeded=exit_code == 0, message=message)
        try:
            summary = json.loads(message) if message.strip().startswith("{") else None
        except ValueError:
            summary = None
        if not isinstance(summary, dict):
            return result
        result.manifest_digest = summary.get("manifest_digest")
        result.bytes = _count(summary.get("bytes"))
        result.graphs = _count(summary.get("graphs"))
        durations = summary.get("durations")
        if isinstance(durations, dict):
            result.durations = {str(k): float(v) for k, v in durations.items() if isinstance(v, int | float)}
        if not result.succeeded and summary.get("reason"):
            result.message = str(summary["reason"])
        return result


# What a summary keeps when the whole of it does not fit the termination message.
_TERMINATION_KEYS = ("manifest_digest", "bytes", "graphs", "durations", "reason", "identity",
                     "manifest", "published")


def write_termination_log(summary: dict[str, Any] | str, path: str | None = None) -> None:
    """Write the SAVE container's result where the operator reads it (best effort, never raises).

    `summary`: the JSON summary (success) or the failure reason. `path`: else ENV_TERMINATION_LOG,
    else TERMINATION_LOG. A summary longer than TERMINATION_LIMIT is cut down to the keys
    `SaveResult` reads (and a few for people), so it stays valid JSON.
    """
    if isinstance(summary, str):
        text = summary
    else:
        text = json.dumps(summary, sort_keys=True)
        if len(text) > TERMINATION_LIMIT:
            text = json.dumps({k: summary[k] for k in _TERMINATION_KEYS if k in summary}, sort_keys=True)
    try:
        with open(path or os.environ.get(ENV_TERMINATION_LOG) or TERMINATION_LOG, "w") as f:
            f.write(text[:TERMINATION_LIMIT])
    except OSError:
        pass


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
