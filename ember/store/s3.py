"""A store in an S3 bucket under a prefix (`s3://bucket/prefix`), through boto3: `S3Store`.

boto3 is imported when a store is opened, not with this module: it is in the operator and sidecar
extras only.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ember.store.base import (
    DIGEST_RE,
    BlobInfo,
    BlobMissing,
    HashingWriter,
    Store,
    StoreError,
    StoreUnavailable,
    check_digest,
    check_identity,
    sha256_bytes,
    sha256_file,
    verify_bytes,
)


class S3Store(Store):
    """An S3 bucket and prefix through boto3: standard credential chain, botocore retries with
    backoff, multipart uploads and parallel ranged downloads through the transfer manager."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        retry_mode: str = "standard",
        max_attempts: int = 5,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_concurrency: int = 8,
        multipart_threshold: int = 16 << 20,
        multipart_chunksize: int = 8 << 20,
        addressing_style: str | None = None,
    ) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as exc:  # boto3 is in the operator and sidecar extras
            raise StoreError("S3 stores need boto3: pip install 'ember[sidecar]' (or boto3)") from exc
        if not bucket:
            raise StoreError("S3 store URI names no bucket (expected s3://bucket/prefix)")
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise StoreError(f"retry_mode must be standard, adaptive or legacy, not {retry_mode!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint or os.environ.get("EMBER_S3_ENDPOINT") or None
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(
            region_name=region,
            retries={"mode": retry_mode, "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, max_concurrency * 2),
            # MinIO and most on-prem endpoints want path-style addressing.
            s3={"addressing_style": addressing_style or ("path" if self.endpoint else "auto")},
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, aws_session_token=session_token
        )
        try:
            self.client = session.client("s3", endpoint_url=self.endpoint, config=config)
        except ValueError as exc:  # botocore: "Invalid endpoint: http://" (no host), bad region
            raise StoreError(f"invalid S3 settings (endpoint {self.endpoint!r}): {exc}") from None
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
            # 4 MB pieces to the writers, not 256 KB: fewer hand-offs between the GET, IO and
            # hash threads (sidecar/ember_sidecar/s3fetch.py says what it measured).
            io_chunksize=4 << 20,
            max_io_queue=32,
        )

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", check_digest(digest))

    def _manifest_key(self, identity_hash: str) -> str:
        return self._key("archives", check_identity(identity_hash), "manifest")

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a boto3 call, translating its failures into our error classes."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._translate(what, exc) from exc

    def _translate(self, what: str, exc: Exception) -> StoreError:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        where = f"{self.uri}" + (f" (endpoint {self.endpoint})" if self.endpoint else "")
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StoreUnavailable(
                f"{what}: no S3 credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or mount a credentials secret"
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("404", "NoSuchKey", "NotFound"):
                return BlobMissing(f"{what}: not found in {where}")
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{what}: bucket {self.bucket!r} does not exist at {where}")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken"):
                return StoreUnavailable(f"{what}: access denied by {where} ({code}): check the credentials")
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500"):
                return StoreUnavailable(f"{what}: {where} failed after retries ({code or status})")
            return StoreError(f"{what}: {where} answered {code or status}: {err.get('Message', exc)}")
        if isinstance(exc, S3UploadFailedError):
            return StoreUnavailable(f"{what}: upload to {where} failed after retries: {exc}")
        if isinstance(exc, BotoCoreError | OSError):
            return StoreUnavailable(f"{what}: cannot reach {where}: {exc}")
        return StoreError(f"{what}: {where}: {exc}")

    def has_blob(self, digest: str) -> bool:
        try:
            self._call(f"head blob {digest}", self.client.head_object, Bucket=self.bucket,
                       Key=self._blob_key(digest))
            return True
        except BlobMissing:
            return False

    def blob_size(self, digest: str) -> int:
        head = self._call(f"head blob {digest}", self.client.head_object, Bucket=self.bucket,
                          Key=self._blob_key(digest))
        return int(head["ContentLength"])

    def put_blob(self, data: bytes | str | os.PathLike[str]) -> str:
        if isinstance(data, bytes | bytearray | memoryview):
            digest = sha256_bytes(data)
            if not self.has_blob(digest):
                self._upload(io.BytesIO(bytes(data)), digest)
            return digest
        path = Path(data)
        digest = sha256_file(path)
        if not self.has_blob(digest):
            self._upload(path, digest)  # a path lets the transfer manager read parts in parallel
        return digest

    def _upload(self, source: BinaryIO | Path, digest: str) -> None:
        # One PUT (or CompleteMultipartUpload) makes the object visible whole: no temp key needed.
        extra = {"Metadata": {"sha256": digest}}
        key = self._blob_key(digest)
        if isinstance(source, Path):
            self._call(f"upload blob {digest}", self.client.upload_file, str(source), self.bucket, key,
                       ExtraArgs=extra, Config=self.transfer)
        else:
            self._call(f"upload blob {digest}", self.client.upload_fileobj, source, self.bucket, key,
                       ExtraArgs=extra, Config=self.transfer)

    def get_blob_bytes(self, digest: str, size: int | None = None) -> bytes:
        buf = io.BytesIO()
        self._call(f"download blob {digest}", self.client.download_fileobj, self.bucket,
                   self._blob_key(digest), buf, Config=self.transfer)
        data = buf.getvalue()
        verify_bytes(data, digest, self.uri, size)
        return data

    def fetch_blob(self, digest: str, dest: str | os.PathLike[str], size: int | None = None) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        writer = HashingWriter(dest, digest, size)
        try:
            # Objects above multipart_threshold come down as parallel ranged GETs, written (and
            # hashed) in order: no second pass over the file to verify it.
            self._call(f"download blob {digest}", self.client.download_fileobj, self.bucket,
                       self._blob_key(digest), writer, Config=self.transfer)
            writer.finish(self.uri)
        finally:
            writer.discard()
        return dest

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Contents", [])
        except Exception as exc:
            raise self._translate(f"list {prefix}", exc) from exc

    def iter_blobs(self) -> Iterator[BlobInfo]:
        base = self._key("blobs") + "/"
        for obj in self._list(base):
            name = obj["Key"][len(base):]
            if DIGEST_RE.match(name):
                yield BlobInfo(name, int(obj["Size"]), obj["LastModified"].timestamp())

    def delete_blob(self, digest: str) -> None:
        self._call(f"delete blob {digest}", self.client.delete_object, Bucket=self.bucket,
                   Key=self._blob_key(digest))

    def put_manifest(self, identity_hash: str, data: bytes) -> None:
        self._call(f"put manifest {identity_hash}", self.client.put_object, Bucket=self.bucket,
                   Key=self._manifest_key(identity_hash), Body=data, ContentType="application/json")

    def get_manifest(self, identity_hash: str) -> bytes | None:
        try:
            resp = self._call(f"get manifest {identity_hash}", self.client.get_object, Bucket=self.bucket,
                              Key=self._manifest_key(identity_hash))
            return self._call(f"read manifest {identity_hash}", resp["Body"].read)
        except BlobMissing:
            return None

    def manifest_uri(self, identity_hash: str) -> str:
        return f"s3://{self.bucket}/{self._manifest_key(identity_hash)}"

    def _signature_key(self, identity_hash: str) -> str:
        return self._key("archives", check_identity(identity_hash), "manifest.sig")

    def put_signature(self, identity_hash: str, data: bytes) -> None:
        self._call(f"put signature {identity_hash}", self.client.put_object, Bucket=self.bucket,
                   Key=self._signature_key(identity_hash), Body=data, ContentType="application/json")

    def get_signature(self, identity_hash: str) -> bytes | None:
        try:
            resp = self._call(f"get signature {identity_hash}", self.client.get_object, Bucket=self.bucket,
                              Key=self._signature_key(identity_hash))
            return self._call(f"read signature {identity_hash}", resp["Body"].read)
        except BlobMissing:
            return None

    def list_archives(self) -> list[str]:
        base = self._key("archives") + "/"
        out = []
        for obj in self._list(base):
            parts = obj["Key"][len(base):].split("/")
            if len(parts) == 2 and parts[1] == "manifest":
                out.append(parts[0])
        return sorted(out)

    def delete_archive(self, identity_hash: str) -> bool:
        key = self._manifest_key(identity_hash)
        try:
            self._call(f"head manifest {identity_hash}", self.client.head_object, Bucket=self.bucket, Key=key)
        except BlobMissing:
            return False
        self._call(f"delete manifest {identity_hash}", self.client.delete_object, Bucket=self.bucket, Key=key)
        self._call(f"delete signature {identity_hash}", self.client.delete_object, Bucket=self.bucket,
                   Key=self._signature_key(identity_hash))  # S3 deletes of a missing key succeed
        return True

    def check(self) -> None:
        try:
            self._call("check store", self.client.head_bucket, Bucket=self.bucket)
        except BlobMissing:  # HEAD has no error body: a bare 404 means the bucket is missing
            msg = f"check store: bucket {self.bucket!r} does not exist at {self.uri}"
            raise StoreUnavailable(msg) from None
