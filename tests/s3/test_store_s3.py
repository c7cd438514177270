"""S3Store against the real local MinIO (`minio` fixture): blobs, multipart uploads, parallel
ranged fetches, manifests, whole archives, and clean failures for bad buckets and credentials."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ember.archive import bundle
from ember.archive.gc import unreferenced_blobs
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import BlobCorrupt, BlobMissing, S3Store, StoreUnavailable, open_manifest_uri, open_store
from ember_sidecar.fetching import ArchiveCache
from ember_testing.synthetic import synthetic_graphset, synthetic_images

pytestmark = pytest.mark.s3

MiB = 1 << 20


def s3_opts(minio: Any, **extra: Any) -> dict[str, Any]:
    return dict(endpoint=minio.endpoint, access_key=minio.access_key, secret_key=minio.secret_key,
                region=minio.region, **extra)


@pytest.fixture
def store(minio: Any) -> Iterator[S3Store]:
    """A store under a fresh prefix; its objects are removed afterwards."""
    prefix = f"test-store/{uuid.uuid4().hex}"
    opts = s3_opts(minio, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
    st = open_store(f"s3://{minio.bucket}/{prefix}", **opts)
    assert isinstance(st, S3Store)
    yield st
    client = minio.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=minio.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=minio.bucket, Key=obj["Key"])


class GetRecorder:
    """Records the Range header of every GetObject the client sends (botocore event hook)."""

    def __init__(self, st: S3Store) -> None:
        self.ranges: list[str | None] = []
        self.threads: set[int] = set()
        self._lock = threading.Lock()
        st.client.meta.events.register("provide-client-params.s3.GetObject", self._record)

    def _record(self, params: dict[str, Any], **_: Any) -> None:
        with self._lock:
            self.ranges.append(params.get("Range"))
            self.threads.add(threading.get_ident())


def test_put_has_get_blob(store: S3Store) -> None:
    store.check()
    data = os.urandom(100_000)
    digest = store.put_blob(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.has_blob(digest) and store.blob_size(digest) == len(data)
    assert store.get_blob_bytes(digest, size=len(data)) == data
    assert not store.has_blob("00" * 32)
    with pytest.raises(BlobMissing):
        store.get_blob_bytes("00" * 32)
    assert [b.digest for b in store.iter_blobs()] == [digest]


def test_put_skips_blobs_already_present(store: S3Store) -> None:
    digest = store.put_blob(b"shared image")
    puts: list[str] = []
    events = store.client.meta.events
    events.register("provide-client-params.s3.PutObject", lambda params, **_: puts.append("put"))
    events.register("provide-client-params.s3.CreateMultipartUpload", lambda params, **_: puts.append("mpu"))
    assert store.put_blob(b"shared image") == digest
    assert puts == []


def test_multipart_upload_and_parallel_ranged_fetch(store: S3Store, minio: Any, tmp_path: Path) -> None:
    data = os.urandom(23 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    digest = store.put_blob(src)
    head = minio.client().head_object(Bucket=minio.bucket, Key=f"{store.prefix}/blobs/{digest}")
    assert head["ETag"].strip('"').endswith("-5")  # 23 MiB in 5 MiB parts: a 5-part multipart upload
    assert head["Metadata"].get("sha256") == digest

    rec = GetRecorder(store)
    out = store.fetch_blob(digest, tmp_path / "cache" / digest, size=len(data))
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    ranges = [r for r in rec.ranges if r]
    assert len(ranges) >= 5, rec.ranges  # ranged GETs, one per chunk
    assert len(rec.threads) > 1  # issued from several transfer threads
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".part")]


def test_fetch_detects_corruption_in_the_store(store: S3Store, minio: Any, tmp_path: Path) -> None:
    digest = store.put_blob(b"the real bytes")
    key = f"{store.prefix}/blobs/{digest}"
    minio.client().put_object(Bucket=minio.bucket, Key=key, Body=b"the fake bytes")
    with pytest.raises(BlobCorrupt, match="hash to"):
        store.fetch_blob(digest, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(BlobCorrupt, match="hash to"):
        store.get_blob_bytes(digest)
    minio.client().put_object(Bucket=minio.bucket, Key=key, Body=b"the")
    with pytest.raises(BlobCorrupt, match="truncated"):
        store.fetch_blob(digest, tmp_path / "x", size=len(b"the real bytes"))


def test_manifests_list_delete_and_gc(store: S3Store) -> None:
    h1, h2 = "aa" * 32, "bb" * 32
    kept = store.put_blob(b"kept")
    orphan = store.put_blob(b"orphan")
    assert store.get_manifest(h1) is None
    store.put_manifest(h1, b'{"blobs": [{"sha256": "%s"}]}' % kept.encode())
    store.put_manifest(h2, b"{}")
    assert store.get_manifest(h1) is not None
    assert store.list_archives() == [h1, h2]
    assert store.manifest_uri(h1) == f"s3://{store.bucket}/{store.prefix}/archives/{h1}/manifest"
    assert unreferenced_blobs(store, min_age_s=0) == [orphan]
    assert unreferenced_blobs(store, min_age_s=3600) == []  # too young to collect
    assert store.delete_archive(h1) is True and store.delete_archive(h1) is False
    assert store.list_archives() == [h2]
    store.delete_blob(orphan)
    assert not store.has_blob(orphan)


def test_whole_archive_through_s3(store: S3Store, minio: Any, tmp_path: Path) -> None:
    ident = ArchiveIdentity(model="test/s3", engine="transformers", engine_version="0",
                            capture_sizes=(1, 2, 3, 4))
    compat = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580", cuda="13.0")
    gs = synthetic_graphset(graphs=4, nodes=80, groups=2)
    result = bundle.write_archive(store, gs, ident, compat, kernel_images=synthetic_images(),
                                  alloc_log=os.urandom(6 * MiB))  # above the multipart threshold
    assert bundle.verify_archive(store, ident.hash(), ident) == []
    # The sidecar's path: from the manifest URI in the claim annotation to a verified local copy.
    _, ident_hash = open_manifest_uri(result.manifest_uri, **s3_opts(minio))
    assert ident_hash == ident.hash()
    cache = ArchiveCache(tmp_path / "cache", store_options=s3_opts(minio))
    cache.fetch(result.manifest_uri, ident_hash)
    archive = bundle.open_archive(cache.local, ident_hash, expected_identity=ident)
    assert archive.graph_table.to_graphset().graphs == gs.graphs
    assert bundle.verify_archive(tmp_path / "cache", ident.hash()) == []


def test_missing_bucket_and_bad_credentials_are_unavailable(minio: Any) -> None:
    missing = open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p", **s3_opts(minio, max_attempts=2))
    with pytest.raises(StoreUnavailable, match="does not exist"):
        missing.check()
    bad = open_store(f"s3://{minio.bucket}/p", endpoint=minio.endpoint, access_key="wrong",
                     secret_key="wrong", region=minio.region, max_attempts=2)
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"access denied|check the credentials"):
        bad.get_manifest("aa" * 32)
    assert time.monotonic() - t < 30


def test_cli_inspect_and_verify_an_s3_archive(
    store: S3Store, minio: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ident = ArchiveIdentity(model="test/s3-cli", engine="transformers", engine_version="0",
                            capture_sizes=(1, 2))
    compat = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580", cuda="13.0")
    bundle.write_archive(store, synthetic_graphset(graphs=2, nodes=40, groups=1), ident, compat,
                         kernel_images=synthetic_images())
    for key, value in minio.env.items():  # the standard boto3 chain plus EMBER_S3_ENDPOINT
        monkeypatch.setenv(key, value)
    runner = CliRunner()
    out = runner.invoke(app, ["inspect", store.uri, ident.hash(), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["manifest"]["identity"]["model"] == "test/s3-cli"
    ok = runner.invoke(app, ["verify", store.uri, ident.hash()])
    assert ok.exit_code == 0, ok.output
    monkeypatch.setenv("EMBER_S3_ENDPOINT", "http://127.0.0.1:1")
    down = runner.invoke(app, ["verify", store.uri, ident.hash()])
    assert down.exit_code == 2 and "store unavailable" in down.output
