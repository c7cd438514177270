"""LocalStore: content addressing, atomic writes, verified reads, manifests, GC; store URIs."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from ember.store import (
    BlobCorrupt,
    BlobMissing,
    LocalStore,
    S3Store,
    StoreError,
    StoreUnavailable,
    open_manifest_uri,
    open_store,
    split_manifest_uri,
)

H1 = "11" * 32
H2 = "22" * 32


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if p.name.startswith(".")]


def test_put_bytes_and_files_content_addressed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    data = os.urandom(3 << 20)
    digest = store.put_blob(data)
    assert digest == sha(data)
    assert store.has_blob(digest) and store.blob_size(digest) == len(data)
    assert (tmp_path / "s" / "blobs" / digest).read_bytes() == data
    src = tmp_path / "f.bin"
    src.write_bytes(b"file content")
    assert store.put_blob(src) == sha(b"file content")
    assert store.put_blob(str(src)) == sha(b"file content")
    assert store.get_blob_bytes(digest, size=len(data)) == data
    assert leftovers(tmp_path / "s") == []


def test_put_skips_present_blobs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    digest = store.put_blob(b"once")
    path = store.blob_path(digest)
    before = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert store.put_blob(b"once") == digest
    assert path.stat().st_mtime_ns == before


def test_reads_verify_digest_and_size(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    digest = store.put_blob(b"0123456789")
    store.blob_path(digest).write_bytes(b"0123456788")
    with pytest.raises(BlobCorrupt, match="hash to"):
        store.get_blob_bytes(digest)
    with pytest.raises(BlobCorrupt, match="hash to"):
        store.fetch_blob(digest, tmp_path / "out" / "x")
    assert not (tmp_path / "out" / "x").exists() and leftovers(tmp_path / "out") == []
    store.blob_path(digest).write_bytes(b"01234")
    with pytest.raises(BlobCorrupt, match="truncated: 5 bytes, expected 10"):
        store.get_blob_bytes(digest, size=10)
    with pytest.raises(BlobCorrupt, match="truncated"):
        store.fetch_blob(digest, tmp_path / "y", size=10)


def test_fetch_blob_and_fetch_blobs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    blobs = [os.urandom(1000 + i) for i in range(6)]
    digests = [store.put_blob(b) for b in blobs]
    out = store.fetch_blob(digests[0], tmp_path / "one")
    assert out.read_bytes() == blobs[0]
    got = store.fetch_blobs(digests + digests[:2], tmp_path / "many", max_workers=3)
    assert list(got) == digests
    assert all(got[d].read_bytes() == b for d, b in zip(digests, blobs, strict=True))
    with pytest.raises(BlobMissing):
        store.fetch_blob("ff" * 32, tmp_path / "nope")
    with pytest.raises(BlobMissing):
        store.get_blob_bytes("ff" * 32)


def test_manifests_list_uri_and_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert store.get_manifest(H1) is None and store.list_archives() == []
    store.put_manifest(H2, b"{}")
    store.put_manifest(H1, b'{"a": 1}')
    store.put_manifest(H1, b'{"a": 2}')  # replaced atomically
    assert store.get_manifest(H1) == b'{"a": 2}'
    assert store.list_archives() == [H1, H2]
    uri = store.manifest_uri(H1)
    assert uri == f"file://{tmp_path.absolute()}/archives/{H1}/manifest"
    assert split_manifest_uri(uri) == (f"file://{tmp_path.absolute()}", H1)
    reopened, ident = open_manifest_uri(uri)
    assert ident == H1 and reopened.get_manifest(H1) == b'{"a": 2}'
    assert store.delete_archive(H1) is True
    assert store.delete_archive(H1) is False
    assert store.list_archives() == [H2]
    assert leftovers(tmp_path) == []


def test_bad_names_are_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for bad in ("../etc/passwd", "ABC", "a" * 63, ""):
        with pytest.raises(StoreError):
            store.has_blob(bad)
    for bad in ("../x", "a/b", "UPPER" * 8):
        with pytest.raises(StoreError):
            store.put_manifest(bad, b"{}")
    with pytest.raises(StoreError, match="not a manifest URI"):
        split_manifest_uri("s3://bucket/prefix/blobs/" + H1)


def test_check_reports_unwritable_directories(tmp_path: Path) -> None:
    LocalStore(tmp_path / "new").check()
    assert (tmp_path / "new").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StoreUnavailable, match="not writable"):
        LocalStore(blocker / "sub").check()


def test_open_store_uris(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    local = open_store(f"file://{tmp_path}")
    assert isinstance(local, LocalStore) and local.root == tmp_path
    assert local.uri == tmp_path.as_uri()
    s3 = open_store("s3://bucket/some/prefix/", endpoint="http://127.0.0.1:9", access_key="a", secret_key="b")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.uri) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    assert s3.manifest_uri(H1) == f"s3://bucket/some/prefix/archives/{H1}/manifest"
    assert split_manifest_uri(s3.manifest_uri(H1)) == ("s3://bucket/some/prefix", H1)
    assert open_store("s3://bucket", endpoint="http://127.0.0.1:9").manifest_uri(H1) == \
        f"s3://bucket/archives/{H1}/manifest"
    with pytest.raises(StoreError, match="unsupported store URI"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreError, match="file:///absolute"):
        open_store("file://host/path")
    with pytest.raises(StoreError, match="names no bucket"):
        open_store("s3:///prefix")


def test_durable_store_fsyncs_before_the_rename_a_pod_cache_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    durable, cache = LocalStore(tmp_path / "store"), LocalStore(tmp_path / "cache", durable=False)
    ident = "ab" * 32
    durable.put_manifest(ident, b'{"a": 1}')
    assert len(synced) == 1
    cache.put_manifest(ident, b'{"a": 1}')
    assert len(synced) == 1 and cache.get_manifest(ident) == b'{"a": 1}'  # written, atomically, no fsync
