"""Write, read, mirror and verify whole archives (blobs + manifest) in a Store.

- SAVE calls `write_archive(store, graphset, identity, compat, kernel_images=..., ...)`: graph
  table, kernel images, allocation log and RNG state become content-addressed blobs, uploaded in
  parallel; the manifest goes in LAST. Returns a `PublishedArchive` (where, digest, sizes,
  timings), from which SAVE's one summary (`ember.runtime.save.SaveOutcome.summary`) is made.
- The sidecar copies an archive into its local store (`ember_sidecar.fetching`, blobs digest-
  verified, manifest last); the engine opens that copy.
- LOAD calls `open_archive(store_or_uri, identity_hash, expected_identity=...)` and reads
  `archive.graph_table`, `archive.kernel_image(hash)`, `archive.alloc_log`, `archive.rng_state`,
  `archive.manifest.engine` (each blob fetched, digest- and size-checked, decompressed on first use).
- `ember verify` and the sidecar call `verify_archive(...)` → a list of problems (empty = good).

Signatures (ember/archive/signing.py): `write_archive(..., signing_key=...)` stores the manifest's
signature before the manifest; readers given `trusted_keys` check it over the manifest bytes
before parsing them or reading any blob (`ArchiveUntrusted`); the sidecar's copy keeps it.

Every failure is an `ArchiveError` subclass with a message naming the archive and blob:
`ArchiveMissing`, `ArchiveCorrupt` (truncated, bit flip, undecodable), `ArchiveVersionError`,
`ArchiveIdentityMismatch`, `ArchiveUntrusted`. Store outages stay `ember.store.StoreUnavailable`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import zstandard as zstd

from ember.archive import graph_summary, graph_table, signing
from ember.archive.graphs import GraphSet
from ember.archive.manifest import (
    BlobEntry,
    KernelImage,
    Manifest,
    ManifestError,
    ManifestVersionError,
)
from ember.archive.manifest import loads as load_manifest
from ember.archive.signing import Ed25519PrivateKey, TrustedKey
from ember.archive.topology import TopologyGroup, group_graphs
from ember.identity import ArchiveIdentity, CompatKey, identity_short
from ember.store import BlobCorrupt, BlobMissing, Store, open_store, sha256_bytes

GRAPH_TABLE = "graphs"
ALLOC_LOG = "alloc-log"
RNG_STATE = "rng-state"
IMAGE_PREFIX = "image/"
ATTACHMENT_PREFIX = "attachment/"
DEFAULT_LEVEL = 3


class ArchiveError(Exception):
    """The archive cannot be used; the message says which archive, which blob and why."""


class ArchiveMissing(ArchiveError):
    """No manifest for that identity (never saved, still saving, or deleted), or a blob is gone."""


class ArchiveCorrupt(ArchiveError):
    """A blob is truncated, altered (digest mismatch) or does not decode."""


class ArchiveVersionError(ArchiveError):
    """The manifest or graph table was written by a format major version this ember cannot read."""


class ArchiveIdentityMismatch(ArchiveError):
    """The manifest describes another identity than the one asked for."""


class ArchiveUntrusted(ArchiveError):
    """Trusted keys were given and the archive is unsigned or not signed by one of them."""


def image_kind(image: bytes) -> str:
    """cubin | fatbin | fatbin-wrapper | ptx | unknown, from the magic number."""
    head = image[:8]
    if head.startswith(b"\x7fELF"):
        return "cubin"
    if head[:4] == (0xBA55ED50).to_bytes(4, "little"):
        return "fatbin"
    if head[:4] == (0x466243B1).to_bytes(4, "little"):
        return "fatbin-wrapper"
    text = image[:256].lstrip()
    if text.startswith((b"//", b".version", b".target")) or b".version" in image[:4096]:
        return "ptx"
    return "unknown"


def _load_bytes(data: bytes | str | os.PathLike[str]) -> bytes:
    return data if isinstance(data, bytes) else Path(data).read_bytes()


@dataclass
class PublishedArchive:
    """What `write_archive` stored: the manifest, where it is, its digest, sizes and timings."""

    manifest: Manifest
    manifest_digest: str  # sha256 of the manifest bytes as stored
    manifest_uri: str
    bytes: int  # stored bytes of the archive: blobs + manifest
    uploaded_bytes: int  # bytes actually sent (blobs already in the store are skipped)
    durations: dict[str, float] = field(default_factory=dict)
    signed_by: str | None = None  # the signing key's id; None: unsigned


@dataclass(frozen=True)
class _PackedBlob:
    """A blob ready to upload: its bytes as stored and what the manifest says about it."""

    name: str
    data: bytes  # as stored (compressed unless codec is "none")
    size: int  # raw size
    codec: Literal["zstd", "none"]
    raw_sha256: str | None


def write_archive(
    store: Store | str,
    graphset: GraphSet,
    identity: ArchiveIdentity,
    compat: CompatKey,
    *,
    kernel_images: Mapping[str, bytes | str | os.PathLike[str]],
    engine: Mapping[str, Any] | None = None,
    alloc_log: bytes | None = None,
    rng_state: bytes | None = None,
    groups: list[TopologyGroup] | None = None,
    level: int = DEFAULT_LEVEL,
    max_workers: int = 8,
    signing_key: Ed25519PrivateKey | None = None,
    attachments: Mapping[str, bytes] | None = None,
    unions: bool | None = None,
    table: bytes | None = None,
) -> PublishedArchive:
    """Encode, compress and upload an archive; the manifest is written last (its signature, with
    `signing_key`, just before it).

    `table`: the graph table of `graphset` as already encoded (SAVE publishes the bytes it proved,
    never a second encoding); else encoded here, with union templates per `unions` (default:
    `graph_table.unions_by_default()`).
    `attachments`: engine files shipped with the graphs (a compile cache), blobs like the rest.

    `kernel_images` maps the content hash used in `KernelRef.image` to the image bytes (or a
    file). Every image a kernel refers to must be present; extra images are stored too.
    Raises `graph_table.UnsupportedNode` for graphs that cannot be archived and ArchiveError for a
    missing image.
    """
    store = open_store(store) if isinstance(store, str) else store
    t0 = time.perf_counter()
    durations: dict[str, float] = {}
    table_bytes, decoded, groups = _table(graphset, table, groups, level, unions)
    durations["encode"] = time.perf_counter() - t0

    used = _images_used(graphset, kernel_images)
    t = time.perf_counter()
    attachments = attachments or {}
    pending, images = _pack_blobs(table_bytes, kernel_images, used, alloc_log, rng_state, attachments, level)
    durations["compress"] = time.perf_counter() - t

    t = time.perf_counter()
    blobs, uploaded = _upload(store, pending, max_workers)
    durations["upload"] = time.perf_counter() - t

    manifest = Manifest(
        identity=identity,
        identity_hash=identity.hash(),
        compat=compat,
        graphs=graph_summary.summarize(graphset, groups, decoded, GRAPH_TABLE),
        kernel_images=images,
        engine=dict(engine or {}),
        alloc_log=ALLOC_LOG if alloc_log is not None else None,
        rng_state=RNG_STATE if rng_state is not None else None,
        attachments=[ATTACHMENT_PREFIX + name for name in sorted(attachments)],
        blobs=blobs,
    )
    return _publish_manifest(store, manifest, uploaded, durations, t0, signing_key)


def _table(graphset: GraphSet, table: bytes | None, groups: list[TopologyGroup] | None, level: int,
           unions: bool | None) -> tuple[bytes, graph_table.GraphTable, list[TopologyGroup]]:
    """The graph table (given, or encoded here), decoded, and its own topology groups (what the
    manifest's summary describes)."""
    if table is None:
        groups = groups if groups is not None else group_graphs(graphset.graphs, graphset.function_attrs)
        table = graph_table.encode(graphset, groups, level=level, unions=unions)
    decoded = graph_table.GraphTable(table)
    return table, decoded, [TopologyGroup(g.index, g.signature, (g.template, *(m for m in g.members
                                                                                 if m != g.template)))
                            for g in decoded.groups]


def _images_used(graphset: GraphSet, kernel_images: Mapping[str, object]) -> dict[str, int]:
    """Kernels per image content hash; ArchiveError when an image the kernels use is missing."""
    used: dict[str, int] = {}
    for k in graphset.kernels:
        used[k.image] = used.get(k.image, 0) + 1
    missing = sorted(set(used) - set(kernel_images))
    if missing:
        names = [k.name for k in graphset.kernels if k.image == missing[0]][:3]
        raise ArchiveError(
            f"{len(missing)} kernel image(s) used by the graphs were not provided, e.g. {missing[0]} "
            f"(kernels {', '.join(names)}): the native library did not record their load"
        )
    return used


def _pack_blobs(
    table_bytes: bytes,
    kernel_images: Mapping[str, bytes | str | os.PathLike[str]],
    used: dict[str, int],
    alloc_log: bytes | None,
    rng_state: bytes | None,
    attachments: Mapping[str, bytes],
    level: int,
) -> tuple[list[_PackedBlob], list[KernelImage]]:
    """Every blob of the archive as stored (the graph table as is: it is compressed inside; the
    rest zstd), and the manifest's kernel-image entries."""
    comp = zstd.ZstdCompressor(level=level)

    def pack(name: str, raw: bytes) -> _PackedBlob:
        return _PackedBlob(name, comp.compress(raw), len(raw), "zstd", sha256_bytes(raw))

    pending = [_PackedBlob(GRAPH_TABLE, table_bytes, len(table_bytes), "none", None)]
    images: list[KernelImage] = []
    for content_hash in sorted(kernel_images):
        raw = _load_bytes(kernel_images[content_hash])
        pending.append(pack(IMAGE_PREFIX + content_hash, raw))
        images.append(KernelImage(content_hash=content_hash, blob=IMAGE_PREFIX + content_hash, size=len(raw),
                                  kind=image_kind(raw), kernels=used.get(content_hash, 0)))
    if alloc_log is not None:
        pending.append(pack(ALLOC_LOG, alloc_log))
    if rng_state is not None:
        pending.append(pack(RNG_STATE, rng_state))
    for name in sorted(attachments):
        pending.append(pack(ATTACHMENT_PREFIX + name, bytes(attachments[name])))
    return pending, images


def _upload(store: Store, pending: list[_PackedBlob], max_workers: int) -> tuple[list[BlobEntry], int]:
    """Upload every blob in parallel (blobs already stored are skipped); entries in `pending`'s
    order and the bytes actually sent."""

    def one(b: _PackedBlob) -> tuple[BlobEntry, int]:
        present = store.has_blob(sha256_bytes(b.data))
        digest = store.put_blob(b.data)
        return BlobEntry(name=b.name, sha256=digest, size=b.size, compressed_size=len(b.data), codec=b.codec,
                         raw_sha256=b.raw_sha256), 0 if present else len(b.data)

    with ThreadPoolExecutor(max(1, min(max_workers, len(pending)))) as pool:
        results = list(pool.map(one, pending))
    return [e for e, _ in results], sum(n for _, n in results)


def _publish_manifest(store: Store, manifest: Manifest, uploaded: int, durations: dict[str, float],
                      t0: float, signing_key: Ed25519PrivateKey | None = None) -> PublishedArchive:
    """Write the signature, then the manifest (last: it makes the archive visible); say what was
    stored. The signature covers the manifest's exact bytes."""
    data = manifest.to_json()
    signed_by = None
    if signing_key is not None:
        store.put_signature(manifest.identity_hash, signing.sign(data, signing_key))
        signed_by = signing.key_id(signing_key.public_key())
    store.put_manifest(manifest.identity_hash, data)
    durations["total"] = time.perf_counter() - t0
    return PublishedArchive(
        manifest=manifest,
        manifest_digest=sha256_bytes(data),
        manifest_uri=store.manifest_uri(manifest.identity_hash),
        bytes=manifest.total_bytes + len(data),
        uploaded_bytes=uploaded + len(data),
        durations=durations,
        signed_by=signed_by,
    )


# ----------------------------------------------------------------------------------------------
# Reading


def _as_store(store: Store | str | os.PathLike[str]) -> Store:
    return store if isinstance(store, Store) else open_store(os.fspath(store))


def _expected_hash(expected: ArchiveIdentity | str | None) -> str | None:
    return expected.hash() if isinstance(expected, ArchiveIdentity) else expected


def load_manifest_from(store: Store, identity_hash: str | None = None,
                       trusted_keys: Sequence[TrustedKey] = ()) -> tuple[Manifest, str]:
    """Fetch and parse a manifest. With no identity hash, the store must hold exactly one archive.
    With `trusted_keys`, its signature is checked first (ArchiveUntrusted)."""
    manifest, identity_hash, _ = _read_manifest(store, identity_hash, trusted_keys)
    return manifest, identity_hash


MIN_HASH_PREFIX = 8


def resolve_hash(store: Store, text: str) -> str:
    """A full identity hash from `text`: the hash itself, or a unique prefix of at least
    MIN_HASH_PREFIX hex digits of one of the store's archives (e.g. the identity short in a
    GraphArchive's name)."""
    text = text.strip().lower()
    if len(text) == 64 or not all(c in "0123456789abcdef" for c in text):
        return text
    if len(text) < MIN_HASH_PREFIX:
        raise ArchiveMissing(f"identity hash prefix {text!r} is too short: give at least "
                             f"{MIN_HASH_PREFIX} hex")
    found = [h for h in store.list_archives() if h.startswith(text)]
    if len(found) != 1:
        listed = ", ".join(identity_short(h) for h in found[:5])
        raise ArchiveMissing(f"no archive in {store.uri} has identity hash prefix {text}" if not found else
                             f"identity hash prefix {text} is ambiguous in {store.uri}: {listed}")
    return found[0]


def _read_manifest(store: Store, identity_hash: str | None,
                   trusted_keys: Sequence[TrustedKey]) -> tuple[Manifest, str, bytes]:
    if identity_hash is None:
        found = store.list_archives()
        if len(found) != 1:
            raise ArchiveMissing(
                f"{store.uri} holds {len(found)} archives; name one by identity hash"
                + (f" ({', '.join(identity_short(h) for h in found[:5])}…)" if found else "")
            )
        identity_hash = found[0]
    identity_hash = resolve_hash(store, identity_hash)
    data = store.get_manifest(identity_hash)
    if data is None:
        raise ArchiveMissing(
            f"no archive {identity_hash} in {store.uri}: it was never saved, its SAVE has not "
            "finished, or it was deleted"
        )
    check_signature(store, identity_hash, data, trusted_keys)
    try:
        manifest = load_manifest(data)
    except ManifestVersionError as exc:
        raise ArchiveVersionError(f"archive {identity_hash}: {exc}") from exc
    except ManifestError as exc:
        raise ArchiveCorrupt(f"archive {identity_hash}: {exc}") from exc
    return manifest, identity_hash, data


def check_signature(store: Store, identity_hash: str, data: bytes,
                    trusted_keys: Sequence[TrustedKey]) -> str | None:
    """With trusted keys: the signing key's id, or ArchiveUntrusted. Without: None (not checked)."""
    if not trusted_keys:
        return None
    try:
        return signing.verify(data, store.get_signature(identity_hash), trusted_keys).key_id
    except signing.SignatureError as exc:
        raise ArchiveUntrusted(f"archive {identity_hash}: {exc}") from exc


def check_identity(manifest: Manifest, identity_hash: str, expected: ArchiveIdentity | str | None) -> None:
    actual = manifest.identity.hash()
    if manifest.identity_hash != actual:
        raise ArchiveCorrupt(
            f"archive {identity_hash}: manifest identity hashes to {actual}, "
            f"but records {manifest.identity_hash}"
        )
    if actual != identity_hash:
        raise ArchiveIdentityMismatch(
            f"archive stored under {identity_hash} holds identity {actual} "
            f"({manifest.identity.model} / {manifest.identity.engine})"
        )
    want = _expected_hash(expected)
    if want is not None and want != actual:
        raise ArchiveIdentityMismatch(
            f"archive {identity_hash} has identity {actual}, expected {want}: the claim points at "
            "another deployment's archive"
        )


class Archive:
    """An archive opened from a store: the manifest now, blobs on first use (verified)."""

    def __init__(self, store: Store, manifest: Manifest, identity_hash: str) -> None:
        self.store = store
        self.manifest = manifest
        self.identity_hash = identity_hash
        self._blobs: dict[str, bytes] = {}

    @property
    def manifest_uri(self) -> str:
        return self.store.manifest_uri(self.identity_hash)

    def blob_bytes(self, name: str) -> bytes:
        """The blob's uncompressed bytes, after checking size and digests."""
        data = self._blobs.get(name)
        if data is None:
            data = self._blobs[name] = self._read(self.manifest.blob(name))
        return data

    def _read(self, entry: BlobEntry) -> bytes:
        what = f"archive {identity_short(self.identity_hash)} blob {entry.name!r} ({entry.sha256[:12]})"
        try:
            stored = self.store.get_blob_bytes(entry.sha256, size=entry.compressed_size)
        except BlobMissing as exc:
            raise ArchiveMissing(f"{what} is missing from {self.store.uri}: {exc}") from exc
        except BlobCorrupt as exc:
            raise ArchiveCorrupt(f"{what}: {exc}") from exc
        if entry.codec == "none":
            raw = stored
        else:
            try:
                raw = zstd.ZstdDecompressor().decompress(stored, max_output_size=entry.size)
            except zstd.ZstdError as exc:
                raise ArchiveCorrupt(f"{what} does not decompress: {exc}") from exc
        if len(raw) != entry.size:
            raise ArchiveCorrupt(f"{what} decompresses to {len(raw)} bytes, manifest says {entry.size}")
        if entry.raw_sha256 is not None and hashlib.sha256(raw).hexdigest() != entry.raw_sha256:
            raise ArchiveCorrupt(f"{what}: uncompressed bytes do not match their digest")
        return raw

    @cached_property
    def graph_table(self) -> graph_table.GraphTable:
        raw = self.blob_bytes(self.manifest.graphs.table)
        try:
            return graph_table.GraphTable(raw)
        except graph_table.FormatVersionError as exc:
            raise ArchiveVersionError(f"archive {identity_short(self.identity_hash)}: {exc}") from exc
        except graph_table.FormatError as exc:
            raise ArchiveCorrupt(f"archive {identity_short(self.identity_hash)} graph table: {exc}") from exc

    def kernel_image(self, content_hash: str) -> bytes:
        if (img := self.manifest.kernel_image(content_hash)) is not None:
            return self.blob_bytes(img.blob)
        raise ArchiveMissing(f"archive {identity_short(self.identity_hash)} has no kernel image "
                             f"{content_hash}")

    @property
    def alloc_log(self) -> bytes | None:
        return self.blob_bytes(self.manifest.alloc_log) if self.manifest.alloc_log else None

    @property
    def rng_state(self) -> bytes | None:
        return self.blob_bytes(self.manifest.rng_state) if self.manifest.rng_state else None

    def attachment(self, name: str) -> bytes | None:
        """An attached engine file's bytes (verified like every blob); None when not attached."""
        blob = ATTACHMENT_PREFIX + name
        return self.blob_bytes(blob) if blob in self.manifest.attachments else None

    def load_all(self, max_workers: int = 4, *, images: bool = True) -> None:
        """Fetch, verify and decompress every blob now (in parallel), but the attachments (read
        by the engine, `attachment()`) and, with `images=False`, the kernel images."""
        m = self.manifest
        skip = {*self._blobs, *m.attachments, *(k.blob for k in m.kernel_images if not images)}
        names = [b.name for b in self.manifest.blobs if b.name not in skip]
        with ThreadPoolExecutor(max(1, min(max_workers, len(names) or 1))) as pool:
            for name, data in zip(names, pool.map(lambda n: self._read(self.manifest.blob(n)), names),
                                  strict=True):
                self._blobs[name] = data


def open_archive(
    store: Store | str | os.PathLike[str],
    identity_hash: str | None = None,
    *,
    expected_identity: ArchiveIdentity | str | None = None,
    trusted_keys: Sequence[TrustedKey] = (),
) -> Archive:
    """Open an archive: manifest fetched (signature checked with `trusted_keys`), version and
    identity checked; blobs read lazily."""
    st = _as_store(store)
    manifest, identity_hash = load_manifest_from(st, identity_hash, trusted_keys)
    check_identity(manifest, identity_hash, expected_identity)
    return Archive(st, manifest, identity_hash)


def read_archive(
    store: Store | str | os.PathLike[str],
    identity_hash: str | None = None,
    *,
    expected_identity: ArchiveIdentity | str | None = None,
    max_workers: int = 4,
    trusted_keys: Sequence[TrustedKey] = (),
) -> Archive:
    """Open an archive and read every blob now: digests checked, decompressed, table decoded."""
    archive = open_archive(store, identity_hash, expected_identity=expected_identity,
                           trusted_keys=trusted_keys)
    archive.load_all(max_workers)
    _ = archive.graph_table
    return archive


# ----------------------------------------------------------------------------------------------
# Verification


def verify_archive(
    store: Store | str | os.PathLike[str],
    identity_hash: str | None = None,
    expected_identity: ArchiveIdentity | str | None = None,
    trusted_keys: Sequence[TrustedKey] = (),
) -> list[str]:
    """Every problem found, as sentences (empty list = the archive is intact and decodable).

    Checks without a GPU: manifest version and fields, identity hash (stored, recorded, expected),
    every blob present with the right size and digest, decompressible to the recorded size and
    raw digest, the graph table decodable with every reference in range, its graphs matching the
    manifest summary, and every kernel's image in the archive. Store outages raise
    `ember.store.StoreUnavailable` (not an archive problem).
    """
    st = _as_store(store)
    try:
        archive = open_archive(st, identity_hash, expected_identity=expected_identity,
                               trusted_keys=trusted_keys)
    except ArchiveError as exc:
        return [str(exc)]
    problems: list[str] = []
    for entry in archive.manifest.blobs:
        try:
            archive.blob_bytes(entry.name)
        except ArchiveError as exc:
            problems.append(str(exc))
    m = archive.manifest
    names = [b.name for b in m.blobs]
    if len(set(names)) != len(names):
        problems.append("manifest lists a blob name twice")
    for ref in [m.graphs.table, m.alloc_log, m.rng_state, *(i.blob for i in m.kernel_images), *m.attachments]:
        if ref is not None and ref not in names:
            problems.append(f"manifest refers to blob {ref!r} but does not list it")
    if m.graphs.table in names and not any(m.graphs.table in p for p in problems):
        try:
            table = archive.graph_table
            table.validate()
            problems += graph_summary.differences(m, table)
        except ArchiveError as exc:
            problems.append(str(exc))
        except graph_table.FormatError as exc:
            problems.append(f"graph table: {exc}")
    return problems
