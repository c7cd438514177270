"""What every archive store is: the `Store` interface, its errors, digests and verification.

A store keeps content-addressed blobs and one manifest per archive (layout and URIs in
ember/store/__init__.py). It does not compress or interpret blobs: the digest is the sha256 of the
stored bytes and every read verifies it (`BlobCorrupt` otherwise). Backends: ember/store/local.py
(a directory) and ember/store/s3.py (S3 through boto3).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20  # read and copy size for local files


class StoreError(Exception):
    """Something is wrong with a store object or a request (missing blob, bad URI, bad name)."""


class BlobMissing(StoreError):
    """The blob (or manifest) named does not exist in the store."""


class BlobCorrupt(StoreError):
    """Bytes read back do not hash to the digest they are stored under."""


class BlobWrongSize(BlobCorrupt):
    """Bytes read back are not the size the caller expected (truncated, usually)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or used: network, credentials, bucket, outage (after retries)."""


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise StoreError(f"not a sha256 hex digest: {digest!r}")
    return digest


def check_identity(identity_hash: str) -> str:
    # Identity hashes are sha256 hex too; refusing anything else keeps keys free of '/' and '..'.
    if not isinstance(identity_hash, str) or not re.match(r"^[0-9a-f]{8,64}$", identity_hash):
        raise StoreError(f"not an identity hash (lowercase hex): {identity_hash!r}")
    return identity_hash


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int
    modified: float  # seconds since the epoch


class Store(ABC):
    """One archive store. Thread-safe: the sidecar fetches several blobs at once."""

    uri: str

    # ---- blobs ----
    @abstractmethod
    def has_blob(self, digest: str) -> bool: ...

    @abstractmethod
    def put_blob(self, data: bytes | str | os.PathLike[str]) -> str:
        """Store bytes or a file's content under its sha256; skip when present. Returns the digest."""

    @abstractmethod
    def get_blob_bytes(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, verified against the digest (and `size`, when given: a short read
        is reported as truncation rather than as a digest mismatch)."""

    @abstractmethod
    def fetch_blob(self, digest: str, dest: str | os.PathLike[str], size: int | None = None) -> Path:
        """Download the blob to `dest` (atomically, verified). Returns the path."""

    @abstractmethod
    def blob_size(self, digest: str) -> int: ...

    @abstractmethod
    def iter_blobs(self) -> Iterator[BlobInfo]: ...

    @abstractmethod
    def delete_blob(self, digest: str) -> None: ...

    # ---- manifests ----
    @abstractmethod
    def put_manifest(self, identity_hash: str, data: bytes) -> None: ...

    @abstractmethod
    def get_manifest(self, identity_hash: str) -> bytes | None: ...

    @abstractmethod
    def manifest_uri(self, identity_hash: str) -> str: ...

    # The manifest's signature (archives/<hash>/manifest.sig, ember.archive.signing): written
    # before the manifest, deleted with it.
    @abstractmethod
    def put_signature(self, identity_hash: str, data: bytes) -> None: ...

    @abstractmethod
    def get_signature(self, identity_hash: str) -> bytes | None: ...

    @abstractmethod
    def list_archives(self) -> list[str]:
        """Identity hashes that have a manifest, sorted."""

    @abstractmethod
    def delete_archive(self, identity_hash: str) -> bool:
        """Delete the manifest (blobs are shared: ember/archive/gc.py finds the unreferenced ones).
        True if it existed."""

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnavailable with a clear reason unless the store is reachable and usable."""

    # ---- shared helpers ----
    def fetch_blobs(
        self,
        digests: Iterable[str],
        dest_dir: str | os.PathLike[str],
        max_workers: int = 4,
        sizes: dict[str, int] | None = None,
    ) -> dict[str, Path]:
        """Fetch several blobs concurrently into `dest_dir/<digest>`, each verified.

        Blobs already present there with the right digest are not fetched again.
        """
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        wanted = list(dict.fromkeys(check_digest(d) for d in digests))
        sizes = sizes or {}

        def one(digest: str) -> Path:
            path = dest_dir / digest
            if path.exists() and sha256_file(path) == digest:
                return path
            return self.fetch_blob(digest, path, sizes.get(digest))

        if len(wanted) <= 1 or max_workers <= 1:
            return {d: one(d) for d in wanted}
        with ThreadPoolExecutor(max_workers=min(max_workers, len(wanted))) as pool:
            return dict(zip(wanted, pool.map(one, wanted), strict=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def check_size(digest: str, have: int, want: int | None, where: str) -> None:
    """Raise BlobWrongSize unless `have` bytes is the expected size (None: anything goes)."""
    if want is not None and have != want:
        what = "truncated" if have < want else "too long"
        raise BlobWrongSize(f"blob {digest} from {where} is {what}: {have} bytes, expected {want}")


def check_hash(digest: str, got: str, where: str) -> None:
    """Raise BlobCorrupt unless the bytes read hash (`got`) to the digest they are stored under."""
    if got != digest:
        raise BlobCorrupt(
            f"blob {digest} from {where} is corrupt: its bytes hash to {got} (truncated or altered)"
        )


def verify_bytes(data: bytes, digest: str, where: str, size: int | None = None) -> None:
    check_size(digest, len(data), size, where)
    check_hash(digest, sha256_bytes(data), where)


class HashingWriter:
    """A write-only, non-seekable file that hashes what it writes, into a temporary file next to
    `dest`. Given it, s3transfer writes strictly in order (its DeferQueue holds ranges that arrive
    early), so verification overlaps the download. `finish` checks size and digest and renames
    into place; `discard` removes the temporary file if `finish` did not run (or failed).

    The sha256 runs on a thread of its own per writer: s3transfer writes every blob of a transfer
    manager from ONE IO thread, and hashing there capped a 16-core host at ~370 MB/s (1.5x a
    plain boto3 download, benchmarks/results/sidecar-h100-*.md); hashlib releases the GIL."""

    def __init__(self, dest: Path, digest: str, size: int | None) -> None:
        self.digest, self.size, self.dest = digest, size, dest
        fd, self.tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        self.file = os.fdopen(fd, "wb", buffering=0)
        self.sha = hashlib.sha256()
        self.written = 0
        self._chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._hasher = threading.Thread(target=self._hash, name="ember-sha256", daemon=True)
        self._hasher.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self.sha.update(chunk)

    def _stop_hashing(self) -> None:
        if self._hasher.is_alive():
            self._chunks.put(None)
            self._hasher.join()

    def seekable(self) -> bool:
        return False

    def write(self, data: bytes) -> int:
        data = bytes(data)  # the hash thread reads it later: never a buffer the caller reuses
        view = memoryview(data)
        while view:
            view = view[self.file.write(view) or 0:]
        self._chunks.put(data)
        self.written += len(data)
        return len(data)

    def finish(self, where: str) -> None:
        self.file.close()
        self._stop_hashing()
        check_size(self.digest, self.written, self.size, where)
        check_hash(self.digest, self.sha.hexdigest(), where)
        os.replace(self.tmp, self.dest)
        self.tmp = ""

    def discard(self) -> None:
        self._stop_hashing()
        with contextlib.suppress(OSError):
            self.file.close()
        if self.tmp:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            self.tmp = ""
