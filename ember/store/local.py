"""A store in a local directory (`file:///path` or a plain path): `LocalStore`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ember.store.base import (
    CHUNK,
    DIGEST_RE,
    BlobInfo,
    BlobMissing,
    Store,
    StoreUnavailable,
    check_digest,
    check_hash,
    check_identity,
    check_size,
    sha256_bytes,
    sha256_file,
    verify_bytes,
)


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
        return self.root / "archives" / check_identity(identity_hash) / "manifest"

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
                    self._write_atomic(self._blob(digest), iter(lambda: f.read(CHUNK), b""))
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
        verify_bytes(data, digest, self.uri, size)
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
                while chunk := f.read(CHUNK):
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

    def _signature(self, identity_hash: str) -> Path:
        return self._manifest(identity_hash).with_name("manifest.sig")

    def put_signature(self, identity_hash: str, data: bytes) -> None:
        try:
            self._write_atomic(self._signature(identity_hash), [data])
        except OSError as exc:
            raise StoreUnavailable(f"cannot write signature to {self.root}: {exc}") from exc

    def get_signature(self, identity_hash: str) -> bytes | None:
        try:
            return self._signature(identity_hash).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read signature from {self.root}: {exc}") from exc

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
            self._signature(identity_hash).unlink()
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
