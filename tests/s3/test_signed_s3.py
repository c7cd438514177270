"""Signed archives in S3 (the real local MinIO): SAVE's signature lands beside the manifest, the
sidecar's fetch verifies it before any blob and copies it into the pod's cache, an untrusted one
is refused, and deleting the archive deletes the signature too."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.archive import bundle, signing
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import S3Store, open_store
from ember_sidecar.fetching import ArchiveCache, FetchFailed
from ember_testing.synthetic import synthetic_graphset, synthetic_images

pytestmark = pytest.mark.s3

IDENTITY = ArchiveIdentity(model="ember-workload/test", engine="ember-decode", engine_version="0.1.0",
                           capture_sizes=(1, 2))
COMPAT = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580", cuda="13.0")
KEY, OTHER = signing.Ed25519PrivateKey.generate(), signing.Ed25519PrivateKey.generate()


@pytest.fixture
def store(minio: Any) -> Iterator[S3Store]:
    prefix = f"test-signed/{uuid.uuid4().hex}"
    st = open_store(f"s3://{minio.bucket}/{prefix}", endpoint=minio.endpoint, access_key=minio.access_key,
                    secret_key=minio.secret_key, region=minio.region)
    assert isinstance(st, S3Store)
    yield st
    client = minio.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=minio.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=minio.bucket, Key=obj["Key"])


def _trust(key: signing.Ed25519PrivateKey) -> str:
    return signing.trusted_keys_json([("k", signing.public_key_text(key))])


def test_signed_archive_through_s3_and_the_sidecar_cache(store: S3Store, minio: Any, tmp_path: Path) -> None:
    result = bundle.write_archive(store, synthetic_graphset(graphs=3, nodes=20, groups=1), IDENTITY, COMPAT,
                                  kernel_images=synthetic_images(), signing_key=KEY)
    ident = IDENTITY.hash()
    assert store.get_signature(ident) is not None
    opts = {"endpoint": minio.endpoint, "access_key": minio.access_key, "secret_key": minio.secret_key,
            "region": minio.region}

    cache = ArchiveCache(tmp_path / "ok", store_options=opts, retry_s=0.5, trusted_keys=_trust(KEY))
    got = cache.fetch(result.manifest_uri, ident)
    assert got.manifest.identity_hash == ident
    assert cache.local.get_signature(ident) == store.get_signature(ident)
    bundle.open_archive(cache.local, ident, trusted_keys=signing.parse_trusted_keys(_trust(KEY)))

    refusing = ArchiveCache(tmp_path / "no", store_options=opts, retry_s=0.5, trusted_keys=_trust(OTHER))
    with pytest.raises(FetchFailed, match=r"signature-refused: .*does not trust"):
        refusing.fetch(result.manifest_uri, ident)
    assert not list((tmp_path / "no").glob("blobs/*"))

    assert store.delete_archive(ident)
    assert store.get_signature(ident) is None and store.get_manifest(ident) is None
