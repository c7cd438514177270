"""The archive manifest: what an archive is, where it may be LOADed, and every blob it needs.

Written by SAVE (`ember.archive.bundle.write_archive`) as readable JSON at
`<prefix>/archives/<identity-hash>/manifest`, LAST; read by the sidecar (verify before handoff),
LOAD (compat key, blob digests, engine facts), the operator (GraphArchive status) and
`ember inspect`/`ember verify`. The field-by-field spec is docs/archive-format.md.

Versioning: `format_version` is "MAJOR.MINOR". A reader refuses a MAJOR it does not know with
`ManifestVersionError`; a newer MINOR is read for the fields this version knows (unknown fields
are ignored), so minor versions may only add optional fields.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import ember
from ember.identity import ArchiveIdentity, CompatKey

MANIFEST_MAJOR = 1
MANIFEST_MINOR = 2  # 1.1: attachments; 1.2: graphs.unions
MANIFEST_VERSION = f"{MANIFEST_MAJOR}.{MANIFEST_MINOR}"
MANIFEST_KIND = "ember.dev/graph-archive"

_HEX64 = r"^[0-9a-f]{64}$"
_NUMBER_LIST = re.compile(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]")


class ManifestError(ValueError):
    """The manifest cannot be read: not JSON, wrong kind, missing or malformed fields."""


class ManifestVersionError(ManifestError):
    """The manifest was written by a format MAJOR version this reader does not know."""


class _Model(BaseModel):
    # Unknown fields (from newer minor versions) are ignored, known ones validated.
    model_config = ConfigDict(extra="ignore", frozen=True)


class BlobEntry(_Model):
    """One stored blob. `sha256` is the digest of the stored (compressed) bytes = the store key."""

    name: str
    sha256: str = Field(pattern=_HEX64)
    size: int = Field(ge=0, description="uncompressed size in bytes")
    compressed_size: int = Field(ge=0, description="stored size in bytes")
    codec: Literal["zstd", "none"] = "zstd"
    raw_sha256: str | None = Field(
        default=None, pattern=_HEX64, description="digest of the uncompressed bytes"
    )


class KernelImage(_Model):
    """A kernel image (cubin, fatbin, PTX) the graphs' kernels are found in at LOAD."""

    content_hash: str = Field(description="the native library's content hash (KernelRef.image)")
    blob: str = Field(description="name of the BlobEntry holding the image")
    size: int = Field(ge=0)
    kind: str = Field(description="cubin | fatbin | fatbin-wrapper | ptx | unknown")
    kernels: int = Field(default=0, ge=0, description="kernels of the archive found in this image")


class TopologyGroupSummary(_Model):
    signature: str = Field(description="hex topology signature (ember.archive.topology)")
    keys: list[list[int]] = Field(description="graph keys in this group, in archive order")
    template: list[int] = Field(description="key of the graph LOAD instantiates for the group")
    nodes: int = Field(ge=0)
    edges: int = Field(ge=0)


class UnionSummary(_Model):
    keys: list[list[int]] = Field(description="keys of the graphs one union template serves")
    nodes: int = Field(ge=0, description="the template's nodes")
    optional: int = Field(ge=0, description="its nodes some member lacks (disabled for that member)")


class GraphsSummary(_Model):
    table: str = Field(description="name of the BlobEntry holding the graph table")
    table_version: str = Field(description="graph table format version MAJOR.MINOR")
    count: int = Field(ge=0)
    keys: list[list[int]]
    nodes: int = Field(ge=0, description="nodes over all graphs, children and union templates included")
    node_types: dict[str, int] = Field(default_factory=dict, description="node type name → count")
    kernels: int = Field(ge=0, description="distinct kernels (image, name)")
    groups: list[TopologyGroupSummary] = Field(default_factory=list)
    unions: list[UnionSummary] = Field(default_factory=list)


class Manifest(_Model):
    kind: str = MANIFEST_KIND
    format_version: str = MANIFEST_VERSION
    ember_version: str = ember.__version__
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    identity: ArchiveIdentity
    identity_hash: str = Field(pattern=_HEX64)
    compat: CompatKey
    graphs: GraphsSummary
    kernel_images: list[KernelImage] = Field(default_factory=list)
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="engine facts LOAD reuses: kv_cache_bytes, num_blocks, max_batch_tokens, ...",
    )
    alloc_log: str | None = Field(default=None, description="BlobEntry name of the allocation log")
    rng_state: str | None = Field(default=None, description="BlobEntry name of the RNG state")
    attachments: list[str] = Field(
        default_factory=list,
        description="BlobEntry names of engine files shipped with the graphs (e.g. a compile cache)",
    )
    blobs: list[BlobEntry] = Field(default_factory=list)

    def blob(self, name: str) -> BlobEntry:
        if (entry := self.blob_index.get(name)) is None:
            raise ManifestError(f"manifest names no blob {name!r}")
        return entry

    def kernel_image(self, content_hash: str) -> KernelImage | None:
        return self.image_index.get(content_hash)

    # LOAD looks up every blob by name and every image by hash: indexes, not scans (the model is frozen)
    @cached_property
    def blob_index(self) -> dict[str, BlobEntry]:
        return {b.name: b for b in self.blobs}

    @cached_property
    def image_index(self) -> dict[str, KernelImage]:
        return {k.content_hash: k for k in self.kernel_images}

    @property
    def total_bytes(self) -> int:
        """Stored bytes of all blobs (what a fetch moves), manifest excluded."""
        return sum(b.compressed_size for b in self.blobs)

    @property
    def raw_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    def to_json(self) -> bytes:
        """Indented JSON with lists of numbers kept on one line (graph keys stay readable)."""
        text = json.dumps(self.model_dump(mode="json"), indent=1, ensure_ascii=False)
        text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
        return (text + "\n").encode()


def parse_version(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(text))
    if not m:
        raise ManifestError(f"manifest format_version {text!r} is not MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2))


def loads(data: bytes | str) -> Manifest:
    """Parse manifest JSON; refuse unknown major versions with a message that says what to do."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest is not valid JSON ({exc}); the archive is damaged") from exc
    if not isinstance(raw, dict):
        raise ManifestError("manifest is not a JSON object; the archive is damaged")
    if raw.get("kind") != MANIFEST_KIND:
        raise ManifestError(f"not an ember manifest (kind={raw.get('kind')!r}, expected {MANIFEST_KIND!r})")
    major, minor = parse_version(raw.get("format_version", ""))
    if major != MANIFEST_MAJOR:
        raise ManifestVersionError(
            f"archive manifest format {major}.{minor} is not readable by ember {ember.__version__} "
            f"(reads {MANIFEST_MAJOR}.x): {'upgrade ember' if major > MANIFEST_MAJOR else 'SAVE again'}"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"manifest fields are invalid: {exc}") from exc


def referenced_digests(data: bytes | str) -> set[str]:
    """Blob digests a manifest keeps alive (for store GC). Tolerant: works across versions."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return set()
    out: set[str] = set()
    for b in raw.get("blobs", []) if isinstance(raw, dict) else []:
        if isinstance(b, dict) and isinstance(b.get("sha256"), str):
            out.add(b["sha256"])
    return out
