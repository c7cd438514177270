"""The sidecar's fetch path against the real local MinIO (no Kubernetes): parallel ranged reads of
a large blob, shared blobs fetched once, an outage mid-way through the archive."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from support.cluster import LocalMinio
from support.sidecar import RecordingReporter, ThrottledProxy, sample, wait_for

from ember import handoff
from ember.store import open_store
from ember_sidecar.claims import Claim
from ember_sidecar.fetching import ArchiveCache, FetchFailed
from ember_sidecar.metrics import Metrics
from ember_sidecar.restoring import Restorer
from ember_sidecar.settings import Settings
from ember_testing.archives import sample_identity, write_blob_archive

pytestmark = pytest.mark.s3


def _store(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch, endpoint: str | None = None):
    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    settings = Settings.from_env(s3_endpoint=endpoint or minio.endpoint, s3_max_attempts=2,
                                 s3_connect_timeout=1, s3_read_timeout=5, fetch_retry_s=1.5)
    return settings


def test_large_blob_ranged_fetch_and_shared_blobs(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    settings = _store(minio, monkeypatch)
    prefix = f"s3://{minio.bucket}/sidecar-s3-{uuid.uuid4().hex[:8]}"
    store = open_store(prefix, **settings.store_options())
    # 40 MB > the 16 MB multipart threshold: fetched as parallel ranged GETs.
    a = write_blob_archive(store, [65_536, 40_000_000, 1_000_000], identity=sample_identity("a"))
    b = write_blob_archive(store, [65_536, 40_000_000, 3_000], identity=sample_identity("b"))  # same seed
    shared = {x.sha256 for x in a.blobs} & {x.sha256 for x in b.blobs}
    assert len(shared) == 2

    writer = handoff.HandoffWriter(tmp_path / "run")
    cache = ArchiveCache(writer.cache_dir, store_options=settings.store_options(), retry_s=1.5)
    fa = cache.fetch(store.manifest_uri(a.identity_hash), a.identity_hash)
    assert not fa.cached and fa.bytes_fetched >= 41_000_000
    fb = cache.fetch(store.manifest_uri(b.identity_hash), b.identity_hash)
    assert fb.bytes_fetched < 100_000, "blobs shared with the cached archive are not fetched again"
    for m in (a, b):
        for blob in m.blobs:
            assert cache.blob_path(blob.sha256).read_bytes() == store.get_blob_bytes(blob.sha256)
    assert cache.fetch(store.manifest_uri(a.identity_hash), a.identity_hash).cached


def test_outage_during_fetch_falls_back(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    host, port = minio.endpoint.removeprefix("http://").split(":")
    proxy = ThrottledProxy(host, int(port), bytes_per_s=3_000_000)
    try:
        settings = _store(minio, monkeypatch, endpoint=proxy.endpoint)
        store = open_store(f"s3://{minio.bucket}/sidecar-s3-{uuid.uuid4().hex[:8]}",
                           endpoint=minio.endpoint)
        m = write_blob_archive(store, [65_536, 30_000_000])
        writer = handoff.HandoffWriter(tmp_path / "run")
        cache = ArchiveCache(writer.cache_dir, store_options=settings.store_options(), retry_s=1.5)
        reporter = RecordingReporter()
        r = Restorer(cache, writer, Metrics(), reporter)
        threading.Timer(1.0, proxy.cut).start()  # MinIO goes away a second into the download
        r.claim(Claim(store.manifest_uri(m.identity_hash), m.identity_hash))
        res = handoff.wait_for_archive(writer.run_dir, deadline=120)
        assert not res.restored and res.reason.startswith("store-unavailable"), res.reason
        assert sample(r.metrics, "ember_restores_total", result="fallback", reason="store-unavailable") == 1
        r.stop()
        assert not any(p.name.startswith(".") for p in (writer.cache_dir / "blobs").iterdir())
    finally:
        proxy.close()


def test_missing_blob_is_a_fallback_reason(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    settings = _store(minio, monkeypatch)
    store = open_store(f"s3://{minio.bucket}/sidecar-s3-{uuid.uuid4().hex[:8]}", **settings.store_options())
    m = write_blob_archive(store, [1000, 2000])
    store.delete_blob(m.blobs[1].sha256)
    cache = ArchiveCache(tmp_path / "cache", store_options=settings.store_options(), retry_s=1.0)
    with pytest.raises(FetchFailed, match=r"^blob-missing"):
        cache.fetch(store.manifest_uri(m.identity_hash), m.identity_hash)


def test_claim_during_prefetch_of_the_same_archive_waits_for_it(
    minio: LocalMinio, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host, port = minio.endpoint.removeprefix("http://").split(":")
    proxy = ThrottledProxy(host, int(port), bytes_per_s=4_000_000)
    try:
        settings = _store(minio, monkeypatch, endpoint=proxy.endpoint)
        store = open_store(f"s3://{minio.bucket}/sidecar-s3-{uuid.uuid4().hex[:8]}", endpoint=minio.endpoint)
        m = write_blob_archive(store, [65_536, 12_000_000])
        writer = handoff.HandoffWriter(tmp_path / "run")
        r = Restorer(ArchiveCache(writer.cache_dir, **settings.cache_options()), writer, Metrics(),
                     RecordingReporter())
        uri = store.manifest_uri(m.identity_hash)
        r.on_annotations({"ember.dev/prefetch": uri})
        threading.Event().wait(0.5)
        r.claim(Claim(uri, m.identity_hash))
        res = handoff.wait_for_archive(writer.run_dir, deadline=60)
        assert res.restored, res.reason
        wait_for(lambda: sample(r.metrics, "ember_prefetches_total", result="ok") == 1,
                 what="the prefetch to complete (not cancelled)")
        assert sample(r.metrics, "ember_restore_stage_seconds_sum", stage="fetch") == 0.0, "fetched once"
        r.stop()
    finally:
        proxy.close()


@pytest.mark.parametrize(("body_size", "word"), [(500_000, "truncated"), (20_000_000, "truncated"),
                                                 (1_500_000, "too long")])
def test_object_of_the_wrong_size_is_a_size_mismatch(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path, body_size: int, word: str) -> None:
    settings = _store(minio, monkeypatch)
    store = open_store(f"s3://{minio.bucket}/sidecar-s3-{uuid.uuid4().hex[:8]}", **settings.store_options())
    # A 1 MB blob (one GET) and a 24 MB blob (ranged GETs); one of them replaced by other bytes.
    m = write_blob_archive(store, [1_000_000, 24_000_000])
    victim = m.blobs[1] if body_size > 2_000_000 else m.blobs[0]
    minio.client().put_object(Bucket=minio.bucket, Key=f"{store.prefix}/blobs/{victim.sha256}",
                              Body=b"\1" * body_size)
    cache = ArchiveCache(tmp_path / "cache", **settings.cache_options())
    with pytest.raises(FetchFailed, match=rf"^size-mismatch: .* is {word}"):
        cache.fetch(store.manifest_uri(m.identity_hash), m.identity_hash)
    assert not [p for p in (tmp_path / "cache" / "blobs").iterdir() if p.name.startswith(".")]
