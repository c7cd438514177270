"""Fetch an archive from its store into the pod's cache and verify it (digests and identity).

The cache is a local store inside the run directory (`<run_dir>/store`, see ember.handoff), so
blobs shared by several archives (kernel images of one engine version) are fetched once, and a
cached archive is never fetched again during the pod's lifetime. Like every store, the cache's
manifest is written last: a manifest in the cache means every blob it names is there, verified.

Failures become `FetchFailed(reason)` with a reason of the form `<class>: <detail>` (the class is
the metric label): store-unavailable, store-error, archive-missing, manifest-invalid,
manifest-digest-mismatch (the manifest's sha256 is not the claim's pin), signature-refused (a
trust list is set, EMBER_TRUSTED_KEYS, and the manifest is unsigned or not signed by a trusted
key: checked before any blob is fetched), identity-mismatch, digest-mismatch, blob-missing,
size-mismatch, fetch-timeout. Cancellation
(pod deleted, SIGTERM) raises `Cancelled`; partial files are removed by `clean_partials`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ember.archive import manifest as manifest_mod
from ember.archive import signing
from ember.archive.manifest import Manifest, ManifestError
from ember.identity import digest_short, identity_short
from ember.store import (
    BlobCorrupt,
    BlobMissing,
    BlobWrongSize,
    LocalStore,
    S3Store,
    Store,
    StoreError,
    StoreUnavailable,
    open_store,
    split_manifest_uri,
)
from ember_sidecar import s3fetch
from ember_sidecar.s3fetch import Cancelled  # one for both fetch paths: s3fetch raises it too

log = logging.getLogger(__name__)
T = TypeVar("T")


class FetchFailed(Exception):
    """The archive cannot be used; `reason` goes to the handoff, the event and the metric."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Fetched:
    """A verified archive in the cache, and what getting it cost."""

    identity: str
    archive_dir: Path
    manifest: Manifest
    fetch_s: float
    verify_s: float
    bytes_fetched: int
    cached: bool


def verify_manifest(data: bytes, identity: str) -> Manifest:
    """Parse the manifest and check it is the archive claimed (raises FetchFailed)."""
    try:
        m = manifest_mod.loads(data)
    except ManifestError as exc:
        raise FetchFailed(f"manifest-invalid: {exc}") from exc
    if m.identity_hash != identity:
        raise FetchFailed(
            f"identity-mismatch: manifest is {identity_short(m.identity_hash)}…, "
            f"claim is {identity_short(identity)}…"
        )
    actual = m.identity.hash()
    if actual != identity:
        raise FetchFailed(
            f"identity-mismatch: manifest identity hashes to {identity_short(actual)}…, "
            f"not {identity_short(identity)}…"
        )
    return m


class ArchiveCache:
    """Fetches archives into `<run_dir>/store` and keeps them for the pod's lifetime."""

    def __init__(
        self,
        root: Path,
        *,
        store_options: dict[str, Any] | None = None,
        retry_s: float = 30.0,
        timeout_s: float = 600.0,
        max_workers: int = 4,
        s3_concurrency: int = 10,
        s3_chunk: int = 8 << 20,
        trusted_keys: str = "",
    ) -> None:
        self.root = Path(root)
        self.local = LocalStore(self.root, durable=False)  # lives and dies with the pod
        self.store_options = store_options or {}
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.s3_concurrency, self.s3_chunk = s3_concurrency, s3_chunk
        # EMBER_TRUSTED_KEYS as given: set → every manifest's signature is checked. An unreadable
        # list refuses every archive (it must not turn verification off).
        self.trust_error = ""
        self.trusted: list[signing.TrustedKey] = []
        try:
            self.trusted = signing.parse_trusted_keys(trusted_keys)
        except signing.SigningKeyError as exc:
            self.trust_error = str(exc)
        self._locks: dict[str, threading.Lock] = {}
        self._stores: dict[str, Store] = {}
        self._locks_guard = threading.Lock()

    def lock(self, identity: str) -> threading.Lock:
        """One fetch per identity at a time (a claim waits for a prefetch of the same archive)."""
        with self._locks_guard:
            return self._locks.setdefault(identity, threading.Lock())

    def archive_dir(self, identity: str) -> Path:
        return self.root / "archives" / identity

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest

    def cached(self, identity: str) -> Manifest | None:
        """The cached manifest when the archive is complete in the cache, else None."""
        data = self.local.get_manifest(identity)
        if data is None:
            return None
        try:
            m = verify_manifest(data, identity)
        except FetchFailed:
            return None
        if not all(self._have(b.sha256, b.compressed_size) for b in m.blobs):
            return None
        return m

    def fetch(
        self, archive_uri: str, identity: str, cancel: threading.Event | None = None, digest: str = "",
    ) -> Fetched:
        """Get the archive named by the manifest URI into the cache, verified. Thread-safe.

        `digest` (the claim's pin, sha256 hex of the manifest bytes): any other manifest is
        refused, cached or not; "" (prefetches) takes what the store holds."""
        cancel = cancel or threading.Event()
        with self.lock(identity):
            t0 = time.monotonic()
            m = self.cached(identity)
            if m is not None and (not digest or self._cached_digest(identity) == digest):
                return Fetched(identity, self.archive_dir(identity), m, 0.0, time.monotonic() - t0, 0, True)
            return self._fetch(archive_uri, identity, cancel, digest)

    def _cached_digest(self, identity: str) -> str:
        data = self.local.get_manifest(identity)
        return hashlib.sha256(data).hexdigest() if data is not None else ""

    def _fetch(self, archive_uri: str, identity: str, cancel: threading.Event, digest: str = "") -> Fetched:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        try:
            store_uri, uri_identity = split_manifest_uri(archive_uri)
            store = self.open(store_uri)
        except StoreError as exc:
            raise FetchFailed(f"store-error: {exc}") from exc
        if uri_identity != identity:
            raise FetchFailed(f"identity-mismatch: {archive_uri} names {identity_short(uri_identity)}…")
        data = self._retry(lambda: store.get_manifest(identity), cancel, deadline)
        if data is None:
            raise FetchFailed(f"archive-missing: no manifest at {archive_uri}")
        if digest and (actual := hashlib.sha256(data).hexdigest()) != digest:
            raise FetchFailed(f"manifest-digest-mismatch: manifest at {archive_uri} has sha256 "
                              f"{digest_short(actual)}…, the claim pins {digest_short(digest)}… "
                              "(replaced since the operator saw it)")
        v0 = time.monotonic()
        signature = self._check_signature(store, identity, data, cancel, deadline)
        m = verify_manifest(data, identity)
        verify_s = time.monotonic() - v0

        wanted = [b for b in dict((b.sha256, b) for b in m.blobs).values()
                  if not self._have(b.sha256, b.compressed_size)]
        self._fetch_blobs(store, {b.sha256: b.compressed_size for b in wanted}, cancel, deadline)
        fetch_s = time.monotonic() - t0 - verify_s

        v1 = time.monotonic()
        for b in m.blobs:
            p = self.blob_path(b.sha256)
            size = p.stat().st_size if p.is_file() else -1
            if size != b.compressed_size:
                raise FetchFailed(f"size-mismatch: blob {b.name} ({digest_short(b.sha256)}…) is {size} "
                                  f"bytes, manifest says {b.compressed_size}")
        if signature is not None:  # LOAD checks it again in the engine (EMBER_TRUSTED_KEYS)
            self.local.put_signature(identity, signature)
        self.local.put_manifest(identity, data)  # last: the cached archive now exists
        verify_s += time.monotonic() - v1
        moved = sum(b.compressed_size for b in wanted) + len(data)
        return Fetched(identity, self.archive_dir(identity), m, fetch_s, verify_s, moved, False)

    def _check_signature(self, store: Store, identity: str, data: bytes, cancel: threading.Event,
                         deadline: float) -> bytes | None:
        """The manifest's signature file (None: unsigned); with a trust list, FetchFailed unless
        one trusted key signed these exact bytes. No trust list: not fetched (one request less)."""
        if not self.trusted and not self.trust_error:
            return None
        signature = self._retry(lambda: store.get_signature(identity), cancel, deadline)
        if self.trust_error:
            raise FetchFailed(f"signature-refused: the trusted keys cannot be read ({self.trust_error})")
        if self.trusted:
            try:
                signing.verify(data, signature, self.trusted)
            except signing.SignatureError as exc:
                raise FetchFailed(f"signature-refused: {exc}") from exc
        return signature

    def _have(self, digest: str, size: int) -> bool:
        p = self.blob_path(digest)
        return p.is_file() and p.stat().st_size == size

    def open(self, store_uri: str) -> Store:
        """The store at `store_uri`, opened once per process (a boto3 client costs ~100 ms to make,
        and keeps its connection pool warm between fetches)."""
        with self._locks_guard:
            store = self._stores.get(store_uri)
            if store is None:
                opts = self.store_options if store_uri.startswith("s3://") else {}
                store = self._stores[store_uri] = open_store(store_uri, **opts)
            return store

    def warm(self, store_uri: str) -> None:
        """Open the pool's store before any claim (never raises: a claim retries and reports)."""
        try:
            self.open(store_uri)
        except StoreError as exc:
            log.warning("Could not open store %s ahead of a claim: %s", store_uri, exc)

    def _retry(self, fn: Callable[[], T], cancel: threading.Event, deadline: float) -> T:
        """Call fn, retrying StoreUnavailable with backoff for retry_s (on top of botocore's)."""
        give_up = min(deadline, time.monotonic() + self.retry_s)
        delay = 0.25
        while True:
            if cancel.is_set():
                raise Cancelled()
            try:
                return fn()
            except BlobCorrupt as exc:
                kind = "size-mismatch" if isinstance(exc, BlobWrongSize) else "digest-mismatch"
                raise FetchFailed(f"{kind}: {exc}") from exc
            except BlobMissing as exc:
                raise FetchFailed(f"blob-missing: {exc}") from exc
            except StoreUnavailable as exc:
                if time.monotonic() + delay > give_up:
                    raise FetchFailed(f"store-unavailable: {exc}") from exc
                log.warning("Store unavailable, retrying in %.2fs: %s", delay, exc)
                if cancel.wait(delay):
                    raise Cancelled() from None
                delay = min(delay * 2, 5.0)
            except StoreError as exc:
                raise FetchFailed(f"store-error: {exc}") from exc

    def _fetch_blobs(
        self, store: Store, sizes: dict[str, int], cancel: threading.Event, deadline: float
    ) -> None:
        digests = list(sizes)
        if isinstance(store, S3Store) and digests:
            # One bounded pool of ranged GETs over all blobs, hashed in order as they arrive.
            def run() -> None:
                if time.monotonic() > deadline:
                    raise FetchFailed(f"fetch-timeout: archive not fetched within {self.timeout_s:g}s")
                todo = {d: n for d, n in sizes.items() if not self._have(d, n)}
                s3fetch.fetch_blobs(store, todo, self.root / "blobs", cancel=cancel,
                                    concurrency=self.s3_concurrency, chunk=self.s3_chunk)

            self._retry(run, cancel, deadline)
            return
        def one(digest: str) -> None:
            if cancel.is_set():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise FetchFailed(f"fetch-timeout: archive not fetched within {self.timeout_s:g}s")
            path = self.blob_path(digest)
            self._retry(lambda: store.fetch_blob(digest, path, sizes[digest]), cancel, deadline)

        if not digests:
            return
        if len(digests) == 1 or self.max_workers <= 1:
            for d in digests:
                one(d)
            return
        # Small blobs in parallel; each large one is itself split into parallel ranged GETs.
        pool = ThreadPoolExecutor(max_workers=min(self.max_workers, len(digests)),
                                  thread_name_prefix="ember-fetch")
        futures = [pool.submit(one, d) for d in digests]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                exc = f.exception() if f.done() and not f.cancelled() else None
                if exc is not None:
                    raise exc
        finally:
            for f in futures:
                f.cancel()
            # On cancel, do not wait for a download in flight: its partial file is cleaned up.
            pool.shutdown(wait=not cancel.is_set(), cancel_futures=True)

    def clean_partials(self) -> int:
        """Remove partial downloads (temporary files) left in the cache. Returns how many."""
        n = 0
        for sub in ("blobs", "archives"):
            d = self.root / sub
            if not d.is_dir():
                continue
            # Final names are digests and "manifest"; every temporary file (ours, LocalStore's,
            # s3transfer's renamed-on-completion file) starts with a dot.
            for p in d.rglob(".*"):
                if p.is_file():
                    with contextlib.suppress(OSError):
                        p.unlink()
                        n += 1
        return n
