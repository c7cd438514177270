"""S3 blob downloads through boto3's transfer manager, hashed in order while they arrive.

`ember.store.S3Store.fetch_blob` downloads one blob with parallel ranged GETs into an
`ember.store.HashingWriter` (sha256 computed in order as the ranges arrive). Here all blobs of an
archive go through ONE s3transfer `TransferManager` (one bounded pool of ranged GETs for the
whole archive, botocore retries, s3transfer's own re-reads of broken streams), into the same
hashing writers. Sizes come from the manifest (no HeadObject).
Cancellation cancels the transfers; partial files are removed.

Used by `fetching.ArchiveCache` for S3 stores; other stores use `Store.fetch_blob`.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

from ember.store import BlobWrongSize, HashingWriter, S3Store, StoreError


class Cancelled(Exception):
    """The fetch was cancelled (pod deleted or sidecar stopping); temporary files are removed."""


class BlobTruncated(BlobWrongSize):
    """The stored object is shorter than the manifest says (s3transfer's ranged GET ran past its end)."""


class _ProvideSize:
    """s3transfer subscriber: the size is known from the manifest, so no HeadObject is sent;
    `done` is set when the transfer ends (the waiting loop wakes at once, not at its next poll)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.done = threading.Event()

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self.size)

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        pass

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self.done.set()


def fetch_blobs(
    store: S3Store,
    blobs: dict[str, int],
    dest_dir: Path,
    *,
    cancel: threading.Event | None = None,
    concurrency: int = 10,
    chunk: int = 8 << 20,
    io_chunk: int = 4 << 20,
) -> None:
    """Download `blobs` (digest → size) into `dest_dir/<digest>`, each verified (size, sha256)
    and renamed into place when complete. Raises BlobCorrupt / BlobWrongSize, StoreUnavailable /
    StoreError (as `ember.store` does) or Cancelled; leaves no temporary file behind."""
    from s3transfer.manager import TransferManager
    from s3transfer.subscribers import BaseSubscriber

    cancel = cancel or threading.Event()
    dest_dir.mkdir(parents=True, exist_ok=True)
    subscriber = type("ProvideSize", (_ProvideSize, BaseSubscriber), {})
    writers: list[HashingWriter] = []
    subscribers: list[_ProvideSize] = []
    futures: list[Any] = []
    tm = TransferManager(store.client, _transfer_config(concurrency, chunk, io_chunk))
    failed = True
    try:
        for digest, size in blobs.items():
            writers.append(HashingWriter(dest_dir / digest, digest, size))
            subscribers.append(subscriber(size))
            futures.append(tm.download(store.bucket, store._blob_key(digest), writers[-1],
                                       subscribers=[subscribers[-1]]))
        for w, sub, fut in zip(writers, subscribers, futures, strict=True):
            _finish_blob(store, w, sub, fut, cancel)
        failed = False
    finally:
        _shut_down(tm, futures, writers, cancelled=failed)


def _transfer_config(concurrency: int, chunk: int, io_chunk: int) -> Any:
    from boto3.s3.transfer import TransferConfig

    # io_chunksize: s3transfer hands the writers 256 KB pieces by default; at that size the
    # queue and GIL hand-offs between the GET threads, the IO thread and the hash thread cost
    # more than the hashing (H100 host, 245 MB: 0.44 s vs 0.31 s with 4 MB pieces, plain boto3
    # 0.39 s; benchmarks/results/fetch-variants-H100-20261122.txt). max_io_queue bounds what waits for the
    # IO thread: 32 x 4 MB.
    return TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk,
                          max_concurrency=concurrency, use_threads=True,
                          io_chunksize=io_chunk, max_io_queue=32)


def _finish_blob(
    store: S3Store, w: HashingWriter, sub: _ProvideSize, fut: Any, cancel: threading.Event
) -> None:
    """Wait for one blob's download (waking up for a cancel meanwhile), then verify it into place."""
    while not sub.done.wait(0.05) and not fut.done():
        if cancel.is_set():
            raise Cancelled()
    try:
        fut.result()
    except CancelledError:
        raise Cancelled() from None
    except StoreError:  # already ours (BlobCorrupt included)
        raise
    except Exception as exc:
        if "InvalidRange" in str(exc):
            raise BlobTruncated(f"blob {w.digest} from {store.uri} is truncated: shorter than "
                                f"the {w.size} bytes the manifest says") from exc
        raise store._translate(f"download blob {w.digest}", exc) from exc
    w.finish(store.uri)


def _shut_down(tm: Any, futures: list[Any], writers: list[HashingWriter], *, cancelled: bool) -> None:
    if cancelled:
        # Do not wait for ranges in flight (a slow or dead store would hold up the pod's
        # exit): cancel them in the background; their writers are closed and removed now.
        # (Each future is cancelled itself: TransferManager.shutdown(cancel=True) passes its
        # arguments wrongly in s3transfer 0.19.)
        for fut in futures:
            fut.cancel()
        threading.Thread(target=tm.shutdown, name="ember-s3-cancel", daemon=True).start()
    else:
        tm.shutdown()
    for w in writers:
        w.discard()


__all__ = ["BlobTruncated", "Cancelled", "fetch_blobs"]
