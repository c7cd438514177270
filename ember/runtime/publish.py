"""Writing and reading an archive's blobs + manifest through `ember.store` (the runtime's side).

The byte formats are the archive engineer's: the graph table is `ember.archive.format`, the
manifest is `ember.archive.manifest.Manifest`, the store layout is `ember.store`. This module
only assembles them: compress each blob (zstd), put it content-addressed, write the manifest
LAST (an archive without a manifest does not exist), and the reverse with digest checks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import zstandard as zstd

from ember.archive import format as archive_format
from ember.archive.manifest import (
    BlobEntry,
    GraphsSummary,
    KernelImage,
    Manifest,
    TopologyGroupSummary,
    loads,
)
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import open_store

GRAPH_TABLE = "graphs"
ALLOC_LOG = "alloc_log"
RNG_STATE = "rng_state"


class ArchiveError(RuntimeError):
    """The archive is missing, damaged or does not match its manifest."""


@dataclass
class Image:
    content_hash: str
    data: bytes
    kind: str = "unknown"
    options: dict[str, Any] = field(default_factory=dict)
    kernels: int = 0


@dataclass
class Archive:
    """An archive in memory, as SAVE assembles it and LOAD reads it back."""

    identity: ArchiveIdentity
    compat: CompatKey
    graph_table: bytes
    images: list[Image]  # in execution order (LOAD preloads in this order)
    alloc_log: bytes = b""
    rng_state: bytes = b""
    engine: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def graphs_summary(table: archive_format.GraphTable) -> GraphsSummary:
    counts = table.node_type_counts()
    groups = []
    for g in table.groups:
        ntypes = table.node_types(g.template)
        groups.append(
            TopologyGroupSummary(
                signature=g.signature,
                keys=[list(table.keys[m]) for m in g.members],
                template=list(table.keys[g.template]),
                nodes=len(ntypes),
                edges=len(table.edges(g.template)),
            )
        )
    return GraphsSummary(
        table=GRAPH_TABLE,
        table_version=table.version,
        count=table.count,
        keys=[list(k) for k in table.keys],
        nodes=sum(counts.values()),
        node_types=counts,
        kernels=len(table.kernels),
        groups=groups,
    )


def write(store_uri: str, archive: Archive, level: int = 3) -> tuple[str, str, int]:
    """Publish; returns (manifest URI, manifest sha256, stored bytes)."""
    store = open_store(store_uri)
    comp = zstd.ZstdCompressor(level=level)
    blobs: list[BlobEntry] = []

    def put(name: str, raw: bytes, codec: str = "zstd") -> None:
        data = comp.compress(raw) if codec == "zstd" else raw
        digest = store.put_blob(data)
        blobs.append(
            BlobEntry(
                name=name,
                sha256=digest,
                size=len(raw),
                compressed_size=len(data),
                codec=codec,
                raw_sha256=_sha(raw),
            )
        )

    # The graph table compresses its own chunks; storing it raw avoids a second zstd pass.
    put(GRAPH_TABLE, archive.graph_table, codec="none")
    images = []
    for im in archive.images:
        name = f"image-{im.content_hash}"
        put(name, im.data)
        images.append(
            KernelImage(
                content_hash=im.content_hash, blob=name, size=len(im.data), kind=im.kind, kernels=im.kernels
            )
        )
    if archive.alloc_log:
        put(ALLOC_LOG, archive.alloc_log)
    if archive.rng_state:
        put(RNG_STATE, archive.rng_state)
    engine = dict(archive.engine)
    engine["image_options"] = {im.content_hash: im.options for im in archive.images}
    manifest = Manifest(
        identity=archive.identity,
        identity_hash=archive.identity.hash(),
        compat=archive.compat,
        graphs=graphs_summary(archive_format.decode(archive.graph_table)),
        kernel_images=images,
        engine=engine,
        alloc_log=ALLOC_LOG if archive.alloc_log else None,
        rng_state=RNG_STATE if archive.rng_state else None,
        blobs=blobs,
    )
    data = manifest.model_dump_json(indent=1).encode()
    store.put_manifest(manifest.identity_hash, data)
    archive.manifest = manifest
    return (
        store.manifest_uri(manifest.identity_hash),
        _sha(data),
        sum(b.compressed_size for b in blobs) + len(data),
    )


def read_manifest(store_uri: str, identity_hash: str) -> Manifest:
    store = open_store(store_uri)
    data = store.get_manifest(identity_hash)
    if data is None:
        raise ArchiveError(f"no archive {identity_hash[:16]} in {store_uri}")
    return loads(data)


def read(store_uri: str, manifest: Manifest) -> Archive:
    """Fetch and verify every blob the manifest names."""
    store = open_store(store_uri)
    dec = zstd.ZstdDecompressor()

    def get(name: str) -> bytes:
        entry = manifest.blob(name)
        data = store.get_blob_bytes(entry.sha256, entry.compressed_size)
        if _sha(data) != entry.sha256:
            raise ArchiveError(f"blob {name}: digest mismatch (damaged store)")
        raw = dec.decompress(data, max_output_size=entry.size) if entry.codec == "zstd" else data
        if len(raw) != entry.size or (entry.raw_sha256 and _sha(raw) != entry.raw_sha256):
            raise ArchiveError(f"blob {name}: content does not match the manifest")
        return raw

    options = manifest.engine.get("image_options", {})
    images = [
        Image(k.content_hash, get(k.blob), k.kind, options.get(k.content_hash, {}), k.kernels)
        for k in manifest.kernel_images
    ]
    return Archive(
        identity=manifest.identity,
        compat=manifest.compat,
        graph_table=get(manifest.graphs.table),
        images=images,
        alloc_log=get(manifest.alloc_log) if manifest.alloc_log else b"",
        rng_state=get(manifest.rng_state) if manifest.rng_state else b"",
        engine=dict(manifest.engine),
        manifest=manifest,
    )
