"""`ember ls` and `ember gc` against the real local MinIO, the endpoint given with --endpoint
(credentials from the standard AWS variables, as a user's shell has them)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from ember.archive import bundle
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import S3Store, open_store
from ember_testing.synthetic import synthetic_graphset, synthetic_images

pytestmark = pytest.mark.s3

A = ArchiveIdentity(model="test/a", engine="transformers", engine_version="4.57.0", capture_sizes=(1, 2))
B = A.model_copy(update={"model": "test/b"})
COMPAT = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580.1", cuda="13.0")


@pytest.fixture
def store(minio: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Store]:
    monkeypatch.delenv("EMBER_S3_ENDPOINT", raising=False)  # the CLI gets it from --endpoint only
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", minio.region)
    prefix = f"test-cli/{uuid.uuid4().hex}"
    st = open_store(f"s3://{minio.bucket}/{prefix}", endpoint=minio.endpoint)
    assert isinstance(st, S3Store)
    for identity, graphs in ((A, 4), (B, 2)):
        bundle.write_archive(st, synthetic_graphset(graphs=graphs, nodes=30, groups=1), identity, COMPAT,
                             kernel_images=synthetic_images())
    yield st
    client = minio.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=minio.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=minio.bucket, Key=obj["Key"])


def test_ls_and_gc_with_endpoint(store: S3Store, minio: Any) -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["ls", store.uri, "--endpoint", minio.endpoint, "--json"])
    assert out.exit_code == 0, out.output
    assert {r["identity_hash"] for r in json.loads(out.output)["archives"]} == {A.hash(), B.hash()}
    a_blobs = {b.sha256 for b in bundle.load_manifest_from(store, A.hash())[0].blobs}
    out = runner.invoke(app, ["gc", store.uri, "--endpoint", minio.endpoint, "--keep-identity", A.hash(),
                              "--min-age", "0", "--delete"])
    assert out.exit_code == 0, out.output
    assert store.list_archives() == [A.hash()]
    assert {b.digest for b in store.iter_blobs()} == a_blobs
    assert bundle.verify_archive(store, A.hash(), A) == []
