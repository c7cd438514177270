"""Archive identity (what was captured) and compatibility key (where it can be LOADed).

Used by the operator (to name GraphArchives and SAVE Jobs), by SAVE (to stamp the manifest),
by the sidecar (to verify a fetched manifest) and by LOAD (to refuse a foreign archive).
The identity hash is the sha256 of a canonical JSON encoding, so every component that builds
the same identity gets the same hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def canonical_json(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8. Stable across Python versions."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# Keys of a model configuration that name or describe it without changing any graph.
_CONFIG_NOT_SHAPE = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "id2label", "label2id",
    "torch_dtype_orig", "_attn_implementation_autoset", "auto_map",
})


def config_digest(config: Mapping[str, Any]) -> str:
    """16 hex of a model configuration's shape: architecture, layer and head counts, sizes,
    rope and window settings, dtype (a transformers `config.to_dict()`, a ModelSpec's fields).
    Names, paths and versions are left out: the same shape under another name digests the same."""
    shape = {k: v for k, v in config.items() if k not in _CONFIG_NOT_SHAPE}
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)  # dtypes, enums
    return hashlib.sha256(text.encode()).hexdigest()[:16]


IDENTITY_SHORT_HEX = 16


def identity_short(identity_hash: str) -> str:
    """The identity short: an identity hash's first 16 hex (DNS-1123 safe), for the
    `ember.dev/identity` label, object names and messages. The identity is the `ArchiveIdentity`,
    the identity hash its full SHA-256 hex (`ArchiveIdentity.hash()`)."""
    return identity_hash[:IDENTITY_SHORT_HEX]


def digest_short(digest: str) -> str:
    """A sha256 digest (a manifest's or a blob's) in messages: its first 16 hex, as the
    identity short of an identity hash."""
    return digest[:IDENTITY_SHORT_HEX]


class Parallelism(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tensor: int = Field(1, ge=1)
    expert: int = Field(1, ge=1)
    data: int = Field(1, ge=1)


class ArchiveIdentity(BaseModel):
    """Everything that decides which graphs a SAVE captures. Equal identity → shareable archive."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    revision: str = "main"
    engine: str
    engine_version: str
    capture_sizes: tuple[int, ...]
    graph_mode: str = "full"
    compile: dict[str, str] = Field(default_factory=dict)
    dtype: str = "bfloat16"
    max_num_tokens: int = 8192
    max_batch: int = 512
    parallelism: Parallelism = Parallelism()
    gpu_product: str = ""
    # `config_digest()` of the model's configuration where the identity's maker knows it (every
    # engine does; the operator, which never reads the model, leaves it empty and LOAD compares
    # the archive's recorded digest with the engine's own instead).
    config: str = ""
    # Engine arguments that change graphs (`ember.identity_args.graph_args`: all but a known list,
    # canonical) and the engine image's digest when the image is pinned by one.
    engine_args: tuple[str, ...] = ()
    image_digest: str = ""
    # An engine's own settings that shape its graphs, by name (ember's decode workloads: seed,
    # layers, collectives; vLLM: how ember compiles it, `ember.engines.vllm.args.IDENTITY_WORKLOAD`).
    workload: dict[str, str] = Field(default_factory=dict)

    def canonical(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        for key in ("config", "engine_args", "image_digest", "workload"):
            if not out[key]:
                del out[key]  # identities made without one keep the hash they always had
        return out

    def hash(self) -> str:
        return hashlib.sha256(canonical_json(self.canonical())).hexdigest()

    def short(self) -> str:
        """The identity short (`identity_short`): for Kubernetes labels and object names."""
        return identity_short(self.hash())


class CompatKey(BaseModel):
    """The software and hardware an archive was saved on. LOAD checks it before any graph."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu_name: str
    compute_capability: str
    driver: str
    cuda: str
    torch: str = ""
    triton: str = ""
    engine: str = ""
    env: dict[str, str] = Field(default_factory=dict)

    def mismatches(self, other: CompatKey) -> list[str]:
        """Human-readable differences (empty when compatible)."""
        mine, theirs = self.model_dump(), other.model_dump()
        return [f"{k}: archive={mine[k]!r} here={theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


# Environment variables that change which kernels run or how memory is laid out.
COMPAT_ENV_VARS = (
    "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_CUMEM_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "CUBLAS_WORKSPACE_CONFIG",
    "TORCHINDUCTOR_MAX_AUTOTUNE",
)
