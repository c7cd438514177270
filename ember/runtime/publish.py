"""The runtime's side of archives: what SAVE hands to `ember.archive.bundle` and what LOAD reads.

The formats and the store protocol are the archive engineer's (`ember.archive.bundle`,
`graph_table`, `manifest`, `ember.store`): this module only adds what the runtime needs on top, kept in
the manifest's free-form `engine` facts:
- `image_order`: the kernel images in execution order (templates first, in need order), the
  order LOAD reads and loads them in;
- `image_options`: libember's recorded load options per image (JIT and library options).
The graph table SAVE publishes is the one it proved: the same bytes, handed on, never re-encoded.
SAVE signs the manifest when EMBER_SIGNING_KEY names a key; LOAD checks the signature when
EMBER_TRUSTED_KEYS lists trusted keys (ember/archive/signing.py), before any blob is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.archive import bundle, signing
from ember.archive.graphs import Graph, GraphSet
from ember.archive.manifest import Manifest
from ember.identity import ArchiveIdentity, CompatKey

ArchiveError = bundle.ArchiveError


@dataclass
class Image:
    content_hash: str
    data: bytes
    kind: str = "unknown"
    options: dict[str, Any] = field(default_factory=dict)
    kernels: int = 0


@dataclass
class ArchiveContent:
    """An archive's content in memory, as SAVE assembles it and LOAD reads it back (the archive
    opened in a store, its blobs read on first use, is `ember.archive.bundle.Archive`)."""

    identity: ArchiveIdentity
    compat: CompatKey
    graph_table: bytes
    images: list[Image]  # in execution order (LOAD preloads in this order; empty when libember read them)
    alloc_log: bytes = b""
    rng_state: bytes = b""
    engine: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None
    attachments: dict[str, bytes] = field(default_factory=dict)  # engine files (adapter.attachments())


def write(store_uri: str, archive: ArchiveContent, graph_set: GraphSet) -> tuple[str, str, int]:
    """Publish through bundle.write_archive, the graph table as SAVE proved it (the same bytes:
    never encoded again); returns (manifest URI, manifest sha256, stored bytes)."""
    engine = dict(archive.engine)
    engine["image_order"] = [im.content_hash for im in archive.images]
    engine["image_options"] = {im.content_hash: im.options for im in archive.images}
    res = bundle.write_archive(
        store_uri,
        graph_set,
        archive.identity,
        archive.compat,
        kernel_images={im.content_hash: im.data for im in archive.images},
        engine=engine,
        alloc_log=archive.alloc_log or None,
        rng_state=archive.rng_state or None,
        signing_key=signing.signing_key_from_env(),  # a key that cannot be read fails the SAVE
        attachments=archive.attachments,
        table=archive.graph_table,
    )
    archive.manifest = res.manifest
    return res.manifest_uri, res.manifest_digest, res.bytes


def open_archive(store_uri: str, identity_hash: str,
                 trusted_keys: list[signing.TrustedKey] | None = None) -> bundle.Archive:
    """The archive with its manifest read and identity checked; blobs are read on first use.
    `trusted_keys` (default: EMBER_TRUSTED_KEYS) set → the signature is checked first
    (bundle.ArchiveUntrusted; signing.SigningKeyError for a trust list that cannot be read)."""
    keys = signing.trusted_keys_from_env() if trusted_keys is None else trusted_keys
    return bundle.open_archive(store_uri, identity_hash, trusted_keys=keys)


def read(store_uri: str, identity_hash: str) -> ArchiveContent:
    """Fetch every blob (in parallel), verify digests and sizes, return the runtime's view."""
    arc = bundle.read_archive(store_uri, identity_hash)
    return view(arc)


def execution_order(graph_set: GraphSet, first: list[int]) -> list[str]:
    """Image hashes in the order kernels run: the graphs `first` (the templates, in need order:
    the first needed key's images lead), then the rest; a child graph's where its node runs."""
    seen: dict[str, None] = {}

    def visit(graph: Graph) -> None:
        for node in graph.nodes:
            if isinstance(node.params, Graph):
                visit(node.params)
            elif (k := getattr(node.params, "kernel", None)) is not None:
                seen.setdefault(graph_set.kernels[k].image, None)

    firsts = set(first)
    for i in first + [i for i in range(len(graph_set.graphs)) if i not in firsts]:
        visit(graph_set.graphs[i])
    return list(seen)


def image_order(m: Manifest) -> list[str]:
    """The kernel images' content hashes in execution order (LOAD's preload order)."""
    return list(m.engine.get("image_order") or [k.content_hash for k in m.kernel_images])


def view(arc: bundle.Archive, *, images: bool = True) -> ArchiveContent:
    """The runtime's view of an opened archive: every blob fetched (in parallel) and verified;
    `images=False`: none of the kernel images (libember read them, `ember.runtime.image_reads`)."""
    arc.load_all(images=images)
    m = arc.manifest
    order = image_order(m) if images else []
    options = m.engine.get("image_options", {})
    kinds = {k.content_hash: (k.kind, k.kernels) for k in m.kernel_images}
    content = [
        Image(
            h,
            arc.kernel_image(h),
            kinds.get(h, ("unknown", 0))[0],
            options.get(h, {}),
            kinds.get(h, ("unknown", 0))[1],
        )
        for h in order
    ]
    return ArchiveContent(
        identity=m.identity,
        compat=m.compat,
        graph_table=arc.blob_bytes(m.graphs.table),
        images=content,
        alloc_log=arc.alloc_log or b"",
        rng_state=arc.rng_state or b"",
        engine=dict(m.engine),
        manifest=m,
    )
