"""Content-addressed archive stores: a local directory and S3 (boto3).

Everyone who moves archive bytes goes through `open_store(uri, **opts)`: SAVE uploads blobs then
the manifest, the sidecar fetches and verifies, the operator checks reachability and deletes
archives, `ember inspect`/`ember verify` read. The layout is the same in both backends:

    <prefix>/blobs/<sha256>                         content-addressed blob (zstd, compressed by the writer)
    <prefix>/archives/<identity-hash>/manifest      written LAST: no manifest, no archive

The store does not compress or interpret blobs; the digest is the sha256 of the stored bytes.
Every read verifies that digest (`BlobCorrupt` otherwise). Network, credential and outage
failures surface as `StoreUnavailable` after botocore's retries; everything else that is wrong
is a `StoreError` naming the object.

URIs: `file:///abs/path`, a plain directory path, or `s3://bucket/prefix`. S3 options (keyword
arguments of `open_store`, all optional): endpoint (else `EMBER_S3_ENDPOINT`, else AWS),
region, access_key/secret_key/session_token (else the standard boto3 credential chain),
retry_mode ("standard" | "adaptive"), max_attempts, connect_timeout, read_timeout,
max_concurrency, multipart_threshold, multipart_chunksize, addressing_style.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import queue
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


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
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise StoreError(f"not a sha256 hex digest: {digest!r}")
    return digest


def _check_identity(identity_hash: str) -> str:
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

    @abstractmethod
    def list_archives(self) -> list[str]:
        """Identity hashes that have a manifest, sorted."""

    @abstractmethod
    def delete_archive(self, identity_hash: str) -> bool:
        """Delete the manifest (blobs are shared: see `unreferenced_blobs`). True if it existed."""

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

    def referenced_blobs(self) -> set[str]:
        """Digests named by any manifest in the store."""
        from ember.archive.manifest import referenced_digests

        refs: set[str] = set()
        for identity_hash in self.list_archives():
            data = self.get_manifest(identity_hash)
            if data is not None:
                refs |= referenced_digests(data)
        return refs

    def unreferenced_blobs(self, min_age_s: float = 3600.0) -> list[str]:
        """Blobs no manifest names and older than `min_age_s` (a SAVE uploads blobs before its
        manifest, so young blobs may belong to an archive being written)."""
        refs = self.referenced_blobs()
        now = time.time()
        return sorted(
            b.digest for b in self.iter_blobs() if b.digest not in refs and now - b.modified >= min_age_s
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


# ----------------------------------------------------------------------------------------------
# Local directory


class LocalStore(Store):
    """A directory. Writes go to a temporary file in the target directory, then os.replace.

    `durable=False` skips the fsync before the rename: for caches that die with their pod (the
    sidecar's), where a power loss loses the pod anyway; the rename alone keeps readers from
    seeing a torn file. (On some filesystems, ext4 data=ordered for one, an fsync can also
    force out the blobs written just before it.)"""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = self.root.as_uri()
        self.durable = durable

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / check_digest(digest)

    def blob_path(self, digest: str) -> Path:
        """Where the blob lives (or would live) on disk: readers may mmap it."""
        return self._blob(digest)

    def _manifest(self, identity_hash: str) -> Path:
        return self.root / "archives" / _check_identity(identity_hash) / "manifest"

    def _write_atomic(self, path: Path, chunks: Iterable[bytes]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def has_blob(self, digest: str) -> bool:
        return self._blob(digest).is_file()

    def put_blob(self, data: bytes | str | os.PathLike[str]) -> str:
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                digest = sha256_bytes(data)
                if not self.has_blob(digest):
                    self._write_atomic(self._blob(digest), [bytes(data)])
                return digest
            src = Path(data)
            digest = sha256_file(src)
            if not self.has_blob(digest):
                with open(src, "rb") as f:
                    self._write_atomic(self._blob(digest), iter(lambda: f.read(_CHUNK), b""))
            return digest
        except OSError as exc:
            raise StoreUnavailable(f"cannot write blob to {self.root}: {exc}") from exc

    def _read(self, digest: str) -> bytes:
        try:
            return self._blob(digest).read_bytes()
        except FileNotFoundError:
            raise BlobMissing(f"blob {digest} not found in {self.uri}") from None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read blob {digest} from {self.root}: {exc}") from exc

    def get_blob_bytes(self, digest: str, size: int | None = None) -> bytes:
        data = self._read(digest)
        _verify_bytes(data, digest, self.uri, size)
        return data

    def fetch_blob(self, digest: str, dest: str | os.PathLike[str], size: int | None = None) -> Path:
        dest = Path(dest)
        src = self._blob(digest)
        if not src.is_file():
            raise BlobMissing(f"blob {digest} not found in {self.uri}")
        if size is not None and (have := src.stat().st_size) != size:
            check_size(digest, have, size, self.uri)
        h = hashlib.sha256()

        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    yield chunk
            check_hash(digest, h.hexdigest(), self.uri)

        self._write_atomic(dest, chunks())
        return dest

    def blob_size(self, digest: str) -> int:
        try:
            return self._blob(digest).stat().st_size
        except FileNotFoundError:
            raise BlobMissing(f"blob {digest} not found in {self.uri}") from None

    def iter_blobs(self) -> Iterator[BlobInfo]:
        d = self.root / "blobs"
        if not d.is_dir():
            return
        for p in d.iterdir():
            if DIGEST_RE.match(p.name):
                st = p.stat()
                yield BlobInfo(p.name, st.st_size, st.st_mtime)

    def delete_blob(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._blob(digest).unlink()

    def put_manifest(self, identity_hash: str, data: bytes) -> None:
        try:
            self._write_atomic(self._manifest(identity_hash), [data])
        except OSError as exc:
            raise StoreUnavailable(f"cannot write manifest to {self.root}: {exc}") from exc

    def get_manifest(self, identity_hash: str) -> bytes | None:
        try:
            return self._manifest(identity_hash).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read manifest from {self.root}: {exc}") from exc

    def manifest_uri(self, identity_hash: str) -> str:
        return self._manifest(identity_hash).as_uri()

    def list_archives(self) -> list[str]:
        d = self.root / "archives"
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if (p / "manifest").is_file())

    def delete_archive(self, identity_hash: str) -> bool:
        path = self._manifest(identity_hash)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        return True

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".ember-check-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StoreUnavailable(
                f"local store {self.root} is not writable: {exc} (mount a writable volume there or "
                "fix its owner/permissions)"
            ) from exc


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


def _verify_bytes(data: bytes, digest: str, where: str, size: int | None = None) -> None:
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


# ----------------------------------------------------------------------------------------------
# S3


class S3Store(Store):
    """An S3 bucket and prefix through boto3: standard credential chain, botocore retries with
    backoff, multipart uploads and parallel ranged downloads through the transfer manager."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        retry_mode: str = "standard",
        max_attempts: int = 5,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_concurrency: int = 8,
        multipart_threshold: int = 16 << 20,
        multipart_chunksize: int = 8 << 20,
        addressing_style: str | None = None,
    ) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as exc:  # boto3 is in the operator and sidecar extras
            raise StoreError("S3 stores need boto3: pip install 'ember[sidecar]' (or boto3)") from exc
        if not bucket:
            raise StoreError("S3 store URI names no bucket (expected s3://bucket/prefix)")
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise StoreError(f"retry_mode must be standard, adaptive or legacy, not {retry_mode!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint or os.environ.get("EMBER_S3_ENDPOINT") or None
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(
            region_name=region,
            retries={"mode": retry_mode, "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, max_concurrency * 2),
            # MinIO and most on-prem endpoints want path-style addressing.
            s3={"addressing_style": addressing_style or ("path" if self.endpoint else "auto")},
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, aws_session_token=session_token
        )
        self.client = session.client("s3", endpoint_url=self.endpoint, config=config)
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
            # 4 MB pieces to the writers, not 256 KB: fewer hand-offs between the GET, IO and
            # hash threads (sidecar/ember_sidecar/s3fetch.py says what it measured).
            io_chunksize=4 << 20,
            max_io_queue=32,
        )

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", check_digest(digest))

    def _manifest_key(self, identity_hash: str) -> str:
        return self._key("archives", _check_identity(identity_hash), "manifest")

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a boto3 call, translating its failures into our error classes."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._translate(what, exc) from exc

    def _translate(self, what: str, exc: Exception) -> StoreError:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        where = f"{self.uri}" + (f" (endpoint {self.endpoint})" if self.endpoint else "")
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StoreUnavailable(
                f"{what}: no S3 credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or mount a credentials secret"
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("404", "NoSuchKey", "NotFound"):
                return BlobMissing(f"{what}: not found in {where}")
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{what}: bucket {self.bucket!r} does not exist at {where}")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken"):
                return StoreUnavailable(f"{what}: access denied by {where} ({code}): check the credentials")
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500"):
                return StoreUnavailable(f"{what}: {where} failed after retries ({code or status})")
            return StoreError(f"{what}: {where} answered {code or status}: {err.get('Message', exc)}")
        if isinstance(exc, S3UploadFailedError):
            return StoreUnavailable(f"{what}: upload to {where} failed after retries: {exc}")
        if isinstance(exc, BotoCoreError | OSError):
            return StoreUnavailable(f"{what}: cannot reach {where}: {exc}")
        return StoreError(f"{what}: {where}: {exc}")

    def has_blob(self, digest: str) -> bool:
        try:
            self._call(f"head blob {digest}", self.client.head_object, Bucket=self.bucket,
                       Key=self._blob_key(digest))
            return True
        except BlobMissing:
            return False

    def blob_size(self, digest: str) -> int:
        head = self._call(f"head blob {digest}", self.client.head_object, Bucket=self.bucket,
                          Key=self._blob_key(digest))
        return int(head["ContentLength"])

    def put_blob(self, data: bytes | str | os.PathLike[str]) -> str:
        if isinstance(data, bytes | bytearray | memoryview):
            digest = sha256_bytes(data)
            if not self.has_blob(digest):
                self._upload(io.BytesIO(bytes(data)), digest)
            return digest
        path = Path(data)
        digest = sha256_file(path)
        if not self.has_blob(digest):
            self._upload(path, digest)  # a path lets the transfer manager read parts in parallel
        return digest

    def _upload(self, source: BinaryIO | Path, digest: str) -> None:
        # One PUT (or CompleteMultipartUpload) makes the object visible whole: no temp key needed.
        extra = {"Metadata": {"sha256": digest}}
        key = self._blob_key(digest)
        if isinstance(source, Path):
            self._call(f"upload blob {digest}", self.client.upload_file, str(source), self.bucket, key,
                       ExtraArgs=extra, Config=self.transfer)
        else:
            self._call(f"upload blob {digest}", self.client.upload_fileobj, source, self.bucket, key,
                       ExtraArgs=extra, Config=self.transfer)

    def get_blob_bytes(self, digest: str, size: int | None = None) -> bytes:
        buf = io.BytesIO()
        self._call(f"download blob {digest}", self.client.download_fileobj, self.bucket,
                   self._blob_key(digest), buf, Config=self.transfer)
        data = buf.getvalue()
        _verify_bytes(data, digest, self.uri, size)
        return data

    def fetch_blob(self, digest: str, dest: str | os.PathLike[str], size: int | None = None) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        writer = HashingWriter(dest, digest, size)
        try:
            # Objects above multipart_threshold come down as parallel ranged GETs, written (and
            # hashed) in order: no second pass over the file to verify it.
            self._call(f"download blob {digest}", self.client.download_fileobj, self.bucket,
                       self._blob_key(digest), writer, Config=self.transfer)
            writer.finish(self.uri)
        finally:
            writer.discard()
        return dest

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Contents", [])
        except Exception as exc:
            raise self._translate(f"list {prefix}", exc) from exc

    def iter_blobs(self) -> Iterator[BlobInfo]:
        base = self._key("blobs") + "/"
        for obj in self._list(base):
            name = obj["Key"][len(base):]
            if DIGEST_RE.match(name):
                yield BlobInfo(name, int(obj["Size"]), obj["LastModified"].timestamp())

    def delete_blob(self, digest: str) -> None:
        self._call(f"delete blob {digest}", self.client.delete_object, Bucket=self.bucket,
                   Key=self._blob_key(digest))

    def put_manifest(self, identity_hash: str, data: bytes) -> None:
        self._call(f"put manifest {identity_hash}", self.client.put_object, Bucket=self.bucket,
                   Key=self._manifest_key(identity_hash), Body=data, ContentType="application/json")

    def get_manifest(self, identity_hash: str) -> bytes | None:
        try:
            resp = self._call(f"get manifest {identity_hash}", self.client.get_object, Bucket=self.bucket,
                              Key=self._manifest_key(identity_hash))
            return self._call(f"read manifest {identity_hash}", resp["Body"].read)
        except BlobMissing:
            return None

    def manifest_uri(self, identity_hash: str) -> str:
        return f"s3://{self.bucket}/{self._manifest_key(identity_hash)}"

    def list_archives(self) -> list[str]:
        base = self._key("archives") + "/"
        out = []
        for obj in self._list(base):
            parts = obj["Key"][len(base):].split("/")
            if len(parts) == 2 and parts[1] == "manifest":
                out.append(parts[0])
        return sorted(out)

    def delete_archive(self, identity_hash: str) -> bool:
        key = self._manifest_key(identity_hash)
        try:
            self._call(f"head manifest {identity_hash}", self.client.head_object, Bucket=self.bucket, Key=key)
        except BlobMissing:
            return False
        self._call(f"delete manifest {identity_hash}", self.client.delete_object, Bucket=self.bucket, Key=key)
        return True

    def check(self) -> None:
        try:
            self._call("check store", self.client.head_bucket, Bucket=self.bucket)
        except BlobMissing:  # HEAD has no error body: a bare 404 means the bucket is missing
            msg = f"check store: bucket {self.bucket!r} does not exist at {self.uri}"
            raise StoreUnavailable(msg) from None


# ----------------------------------------------------------------------------------------------
# Entry points


def open_store(uri: str, **opts: Any) -> Store:
    """Open `file:///abs/path`, a plain directory path, or `s3://bucket/prefix`.

    Options are passed to the backend (see the module docstring); LocalStore takes none.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, unquote(parsed.path), **opts)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"file store URI must be file:///absolute/path, got {uri!r}")
        return LocalStore(unquote(parsed.path))
    if parsed.scheme == "":
        return LocalStore(uri)
    raise StoreError(f"unsupported store URI {uri!r}: use file:///abs/path or s3://bucket/prefix")


def split_manifest_uri(uri: str) -> tuple[str, str]:
    """`<store-uri>/archives/<identity-hash>/manifest` → (store URI, identity hash).

    The inverse of `Store.manifest_uri`: the sidecar gets a manifest URI in the claim annotation.
    """
    m = re.match(r"^(?P<store>.*?)/?archives/(?P<ident>[0-9a-f]{8,64})/manifest$", uri)
    if not m:
        raise StoreError(f"not a manifest URI (…/archives/<identity-hash>/manifest): {uri!r}")
    store = m.group("store")
    if store in ("file:", "file://"):
        store = "file:///"
    return store, m.group("ident")


def open_manifest_uri(uri: str, **opts: Any) -> tuple[Store, str]:
    """Open the store that holds the manifest at `uri`; returns (store, identity hash)."""
    store_uri, identity_hash = split_manifest_uri(uri)
    return open_store(store_uri, **opts), identity_hash


__all__ = [
    "BlobCorrupt",
    "BlobInfo",
    "BlobMissing",
    "BlobWrongSize",
    "HashingWriter",
    "LocalStore",
    "S3Store",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "check_digest",
    "check_hash",
    "check_size",
    "open_manifest_uri",
    "open_store",
    "sha256_bytes",
    "sha256_file",
    "split_manifest_uri",
]
