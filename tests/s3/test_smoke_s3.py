"""S3 smoke tests against the real local MinIO: multipart upload and ranged reads via boto3."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest
from boto3.s3.transfer import TransferConfig

pytestmark = pytest.mark.s3

MiB = 1024 * 1024


def test_multipart_upload_and_ranged_read(minio, tmp_path) -> None:
    s3 = minio.client()
    payload = os.urandom(13 * MiB)
    src = tmp_path / "blob.bin"
    src.write_bytes(payload)
    key = f"smoke/{uuid.uuid4().hex}/blob.bin"
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
    try:
        s3.upload_file(str(src), minio.bucket, key, Config=config)

        head = s3.head_object(Bucket=minio.bucket, Key=key)
        assert head["ContentLength"] == len(payload)
        # A multipart object's ETag is "<md5 of part md5s>-<part count>": 13 MiB in 5 MiB parts -> 3.
        assert head["ETag"].strip('"').endswith("-3")

        start, end = 5 * MiB - 100, 5 * MiB + 99  # crosses the first part boundary
        ranged = s3.get_object(Bucket=minio.bucket, Key=key, Range=f"bytes={start}-{end}")
        assert ranged["ContentRange"] == f"bytes {start}-{end}/{len(payload)}"
        assert ranged["Body"].read() == payload[start : end + 1]

        tail = s3.get_object(Bucket=minio.bucket, Key=key, Range="bytes=-10")["Body"].read()
        assert tail == payload[-10:]

        dst = tmp_path / "back.bin"
        s3.download_file(minio.bucket, key, str(dst), Config=config)
        assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(payload).digest()
    finally:
        s3.delete_object(Bucket=minio.bucket, Key=key)


def test_missing_key_is_a_clean_404(minio) -> None:
    from botocore.exceptions import ClientError

    s3 = minio.client()
    with pytest.raises(ClientError) as err:
        s3.head_object(Bucket=minio.bucket, Key=f"smoke/{uuid.uuid4().hex}/absent")
    assert err.value.response["Error"]["Code"] in {"404", "NoSuchKey"}
