"""LOAD's kernel-image reads: every image blob read, verified and handed to libember's loaders,
in the archive's order, as far as the restore lets them go (`allow`).

Two readers with one face. `NativeReads` (the default for a store on local disk, which is where
the sidecar caches an archive): libember's reader threads read each file, check both digests,
decompress it and preload it (native/src/blob_reader.cpp); Python only paces and waits, so the
reads never take the GIL from the template being prepared beside them. `PoolReads` (any other
store, EMBER_NATIVE_READ=0, or a system without libzstd/libcrypto): a thread pool reads through
`bundle.Archive` and this thread hands each image to `Interposer.preload`. Either raises Refused
("archive damaged: ...", naming the blob) for a blob that is missing or does not verify.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Protocol

from ember import settings
from ember.identity import identity_short
from ember.native import EMBER_EUNAVAILABLE, BlobRead, EmberError, ImageReads, Interposer
from ember.runtime.adapter import LOAD, Refused
from ember.store import LocalStore

if TYPE_CHECKING:
    from ember.archive import bundle

THREADS = 4


class Reads(Protocol):
    kind: str  # "native" or "python"

    def allow(self, upto: int) -> None: ...  # the first `upto` images may be read

    def wait(self, i: int, timeout: float) -> int: ...  # leading images handed (> i once image i is)

    def close(self) -> None: ...  # the readers stop; the reads in flight finish


def open_reads(ip: Interposer, arc: bundle.Archive, order: list[str]) -> Reads:
    """libember's reader for a local store unless EMBER_NATIVE_READ=0 or it lacks a codec."""
    options = arc.manifest.engine.get("image_options", {})
    if settings.on("EMBER_NATIVE_READ") and isinstance(arc.store, LocalStore):
        try:
            return NativeReads(ip, arc, order, options)
        except EmberError as exc:
            if exc.code != EMBER_EUNAVAILABLE:
                raise Refused(LOAD, f"libember refused the archive: {exc}") from exc
    return PoolReads(ip, arc, order, options)


class NativeReads:
    kind = "native"

    def __init__(
        self, ip: Interposer, arc: bundle.Archive, order: list[str], options: dict[str, Any]
    ) -> None:
        store = arc.store
        assert isinstance(store, LocalStore)
        self._what = f"archive {identity_short(arc.identity_hash)}"
        blobs = []
        for h in order:
            image = arc.manifest.kernel_image(h)
            if image is None:
                raise Refused(LOAD, f"archive damaged: {self._what} has no kernel image {h}")
            b = arc.manifest.blob(image.blob)
            blobs.append(
                BlobRead(
                    name=b.name.encode(),
                    hash=h.encode(),
                    path=str(store.blob_path(b.sha256)).encode(),
                    sha256=b.sha256.encode(),
                    raw_sha256=b.raw_sha256.encode() if b.raw_sha256 else None,
                    stored_size=b.compressed_size,
                    raw_size=b.size,
                    options_json=json.dumps(options.get(h) or {}).encode(),
                    codec=1 if b.codec == "zstd" else 0,
                )
            )
        self._reads: ImageReads = ip.read_images(blobs, THREADS)

    def allow(self, upto: int) -> None:
        self._reads.allow(upto)

    def wait(self, i: int, timeout: float) -> int:
        try:
            return self._reads.wait(i + 1, timeout)
        except EmberError as exc:
            raise Refused(
                LOAD, f"archive damaged: {self._what} {str(exc).removeprefix('read_images: ')}"
            ) from exc

    def close(self) -> None:
        self._reads.close()


class PoolReads:
    kind = "python"

    def __init__(
        self, ip: Interposer, arc: bundle.Archive, order: list[str], options: dict[str, Any]
    ) -> None:
        self._ip, self._arc, self._order, self._options = ip, arc, order, options
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ember-read")
        self._reads: list[Future[bytes]] = []

    def allow(self, upto: int) -> None:
        order = self._order
        self._reads += [self._pool.submit(self._arc.kernel_image, h) for h in order[len(self._reads) : upto]]

    def wait(self, i: int, timeout: float) -> int:
        """Once image i is read, it and the ones read after it are handed over in one call."""
        reads = self._reads
        if not wait(reads[i : i + 1], timeout).done:
            return i
        j = i + 1
        while j < len(reads) and reads[j].done():
            j += 1
        try:
            data = [f.result() for f in reads[i:j]]
        except Exception as exc:
            raise Refused(LOAD, f"archive damaged: {exc}") from exc
        try:
            self._ip.preload(
                [(h, d, self._options.get(h, {})) for h, d in zip(self._order[i:j], data, strict=True)]
            )
        except EmberError as exc:
            raise Refused(LOAD, f"libember refused the archive: {exc}") from exc
        return j

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # at most the reads in flight
