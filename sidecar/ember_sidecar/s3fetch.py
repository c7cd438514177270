"""Parallel ranged S3 reads of an archive's blobs, hashed in order while they arrive.

The transfer manager (`ember.store.S3Store.fetch_blob`) downloads a blob in parallel ranges and
the sha256 is computed afterwards by reading the file back: the hash costs a second pass after
the last byte. Here every blob of the archive is split into ranges that share ONE pool of
connections (bounded, blob after blob), each range is written at its offset as it arrives, and
the hasher consumes ranges in order from memory while later ranges are still downloading, so
verification overlaps the download. A window bounds the bytes held in memory. Cancellation is
checked between ranges, so a deleted pod stops within one range.

Used by `fetching.ArchiveCache` for S3 stores; other stores use `Store.fetch_blob`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.store import BlobCorrupt, S3Store, StoreError, StoreUnavailable

_READ_RETRIES = 3  # re-reads of one range after a broken stream (botocore retries the request itself)


class Cancelled(Exception):
    """The fetch was cancelled; temporary files are removed."""


class BlobTruncated(BlobCorrupt):
    """The stored object is shorter than the manifest says."""


@dataclass
class _Blob:
    digest: str
    size: int
    dest: Path
    tmp: str = ""
    fd: int = -1
    sha: Any = field(default_factory=hashlib.sha256)
    # Guards fd: after a cancel, range reads still in flight must not write to a closed (and
    # possibly reused) descriptor.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = -1


def _ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    if size == 0:
        return [(0, 0)]
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def fetch_blobs(
    store: S3Store,
    blobs: dict[str, int],
    dest_dir: Path,
    *,
    cancel: threading.Event | None = None,
    concurrency: int = 8,
    chunk: int = 8 << 20,
    on_blob: Callable[[str], None] | None = None,
) -> None:
    """Download `blobs` (digest → size) into `dest_dir/<digest>`, each verified (size, sha256)
    and renamed into place when complete. Raises BlobCorrupt, StoreUnavailable / StoreError (as
    `ember.store` does) or Cancelled; leaves no temporary file behind."""
    cancel = cancel or threading.Event()
    dest_dir.mkdir(parents=True, exist_ok=True)
    items = [_Blob(d, s, dest_dir / d) for d, s in blobs.items()]
    work = [(b, off, n) for b in items for off, n in _ranges(b.size, chunk)]
    window = max(2, concurrency * 2)
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="ember-s3")
    futures: dict[int, Future[bytes]] = {}
    try:
        for b in items:
            fd, b.tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{b.digest}.", suffix=".part")
            b.fd = fd
            os.ftruncate(fd, b.size)

        def get(b: _Blob, off: int, n: int) -> bytes:
            if cancel.is_set():
                raise Cancelled()
            data = _get_range(store, b.digest, off, n)
            if len(data) != n:
                raise BlobTruncated(f"blob {b.digest} from {store.uri} is truncated: range at {off} "
                                    f"gave {len(data)} bytes, expected {n}")
            with b.lock:
                if b.fd < 0 or cancel.is_set():
                    raise Cancelled()
                os.pwrite(b.fd, data, off)
            return data

        submitted = 0
        for i, (b, off, n) in enumerate(work):
            while submitted < len(work) and submitted < i + window:
                futures[submitted] = pool.submit(get, *work[submitted])
                submitted += 1
            fut = futures.pop(i)
            while not fut.done():  # wake up for a cancel even while a slow range is in flight
                if cancel.is_set():
                    raise Cancelled()
                wait([fut], timeout=0.05)
            data = fut.result()
            b.sha.update(data)
            if off + n >= b.size:
                _finish(store, b)
                if on_blob is not None:
                    on_blob(b.digest)
    except BaseException:
        for f in futures.values():
            f.cancel()
        raise
    finally:
        # After a cancel, do not wait for range reads in flight (a slow store would hold the
        # pod's exit): they find their blob closed and drop their bytes.
        pool.shutdown(wait=not cancel.is_set(), cancel_futures=True)
        for b in items:
            b.close()
            if b.tmp:
                with contextlib.suppress(OSError):
                    os.unlink(b.tmp)  # already renamed when complete: only partial files remain


def _finish(store: S3Store, b: _Blob) -> None:
    got = b.sha.hexdigest()
    if got != b.digest:
        raise BlobCorrupt(f"blob {b.digest} from {store.uri} is corrupt: its bytes hash to {got} "
                          "(truncated or altered)")
    b.close()
    os.replace(b.tmp, b.dest)
    b.tmp = ""


def _get_range(store: S3Store, digest: str, off: int, n: int) -> bytes:
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    what = f"download blob {digest} bytes {off}-{off + n - 1}"
    key = store._blob_key(digest)
    last: Exception | None = None
    for _ in range(_READ_RETRIES):
        try:
            kwargs: dict[str, Any] = {"Bucket": store.bucket, "Key": key}
            if n:
                kwargs["Range"] = f"bytes={off}-{off + n - 1}"
            resp = store.client.get_object(**kwargs)
            data: bytes = resp["Body"].read()
            return data
        except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError, ConnectionClosedError) as exc:
            last = exc  # a stream broken mid-body: read the range again
        except Exception as exc:
            if "InvalidRange" in str(exc):
                raise BlobTruncated(f"blob {digest} from {store.uri} is truncated: no bytes at offset "
                                    f"{off}, the manifest says it has more") from exc
            raise store._translate(what, exc) from exc
    raise StoreUnavailable(f"{what}: {store.uri}: stream kept breaking: {last}") from last


__all__ = ["BlobTruncated", "Cancelled", "StoreError", "fetch_blobs"]
