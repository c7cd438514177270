"""Label and annotation keys (the pod protocol in team.md) and deterministic object names.

Every name the operator creates is a pure function of the spec, so a restarted operator finds
what it created before instead of creating a second one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Labels
POOL = "ember.dev/pool"  # warm | serving
DEPLOYMENT = "ember.dev/deployment"
GPU_PRODUCT = "ember.dev/gpu-product"
POOL_KEY = "ember.dev/pool-key"
IDENTITY = "ember.dev/identity"  # label: short hash; annotation: full hash
REVISION = "ember.dev/revision"
ARCHIVE_LABEL = "ember.dev/archive"  # on SAVE Jobs and their pods: the GraphArchive name
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "app.kubernetes.io/component"
OPERATOR_NAME = "ember-operator"

POOL_WARM = "warm"
POOL_SERVING = "serving"

# Annotations (claim protocol)
ARCHIVE = "ember.dev/archive"  # store URI of the manifest; "" → native capture
ENGINE_ARGS = "ember.dev/engine-args"  # JSON list
IDENTITY_SPEC = "ember.dev/identity-spec"  # canonical identity JSON (model, capture, ...)
RANK = "ember.dev/rank"
WORLD = "ember.dev/world"
CLAIMED_AT = "ember.dev/claimed-at"  # RFC 3339 with fractional seconds
NATIVE_REASON = "ember.dev/native-reason"  # claims without an archive: why (capture natively)
PREFETCH = "ember.dev/prefetch"  # warm pods: JSON list of manifest URIs to cache before a claim
RESTORE = "ember.dev/restore"  # written by the sidecar: restored | fallback: <reason>
RESTORE_TIME = "ember.dev/restore-time"  # written by the sidecar (RFC 3339), optional

FINALIZER = "ember.dev/cleanup"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_NODE_LABEL = "nvidia.com/gpu.product"


def short_hash(*parts: Any, length: int = 10) -> str:
    data = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def archive_name(identity_hash: str) -> str:
    """GraphArchive name: `ga-<first 16 hex of the identity hash>`."""
    return f"ga-{identity_hash[:16]}"


def save_job_name(identity_hash: str, attempt: int) -> str:
    """SAVE Job name, deterministic per identity and attempt (a retry is a new attempt)."""
    return f"ember-save-{identity_hash[:16]}-{attempt}"


def hpa_name(md_name: str) -> str:
    return f"{md_name}-ember"


def serving_pod_name(md_name: str, revision: str, index: int) -> str:
    return f"{md_name}-{revision[:8]}-{index}"


def warm_pod_prefix(pool_key: str) -> str:
    return f"ember-warm-{pool_key[:10]}-"


def selector(md_name: str) -> str:
    """status.selector: the serving pods of one deployment (what the HPA counts)."""
    return f"{DEPLOYMENT}={md_name},{POOL}={POOL_SERVING}"
