"""Content-addressed archive stores: a local directory and S3 (boto3).

Everyone who moves archive bytes goes through `open_store(uri, **opts)`: SAVE uploads blobs then
the manifest, the sidecar fetches and verifies, the operator checks reachability and deletes
archives, `ember inspect`/`ember verify` read. The layout is the same in both backends:

    <prefix>/blobs/<sha256>                         content-addressed blob (zstd, compressed by the writer)
    <prefix>/archives/<identity-hash>/manifest      written LAST: no manifest, no archive

The store does not compress or interpret blobs; the digest is the sha256 of the stored bytes.
Every read verifies that digest (`BlobCorrupt` otherwise). Network, credential and outage
failures surface as `StoreUnavailable` after botocore's retries; everything else that is wrong
is a `StoreError` naming the object.

URIs: `file:///abs/path`, a plain directory path, or `s3://bucket/prefix`. S3 options (keyword
arguments of `open_store`, all optional): endpoint (else `EMBER_S3_ENDPOINT`, else AWS),
region, access_key/secret_key/session_token (else the standard boto3 credential chain),
retry_mode ("standard" | "adaptive"), max_attempts, connect_timeout, read_timeout,
max_concurrency, multipart_threshold, multipart_chunksize, addressing_style.

Modules: ember/store/base.py (the `Store` interface, errors, digests, `HashingWriter`),
ember/store/local.py (`LocalStore`), ember/store/s3.py (`S3Store`); this one opens a store from a
URI and re-exports what callers use. Garbage collection of blobs no manifest names reads manifests,
so it lives with the archive format (ember/archive/gc.py).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlparse

from ember.store.base import (
    BlobCorrupt,
    BlobInfo,
    BlobMissing,
    BlobWrongSize,
    HashingWriter,
    Store,
    StoreError,
    StoreUnavailable,
    check_digest,
    check_hash,
    check_size,
    sha256_bytes,
    sha256_file,
)
from ember.store.local import LocalStore
from ember.store.s3 import S3Store


def open_store(uri: str, **opts: Any) -> Store:
    """Open `file:///abs/path`, a plain directory path, or `s3://bucket/prefix`.

    Options are passed to the backend (see the module docstring); LocalStore takes none.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, unquote(parsed.path), **opts)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"file store URI must be file:///absolute/path, got {uri!r}")
        return LocalStore(unquote(parsed.path))
    if parsed.scheme == "":
        return LocalStore(uri)
    raise StoreError(f"unsupported store URI {uri!r}: use file:///abs/path or s3://bucket/prefix")


def split_manifest_uri(uri: str) -> tuple[str, str]:
    """`<store-uri>/archives/<identity-hash>/manifest` → (store URI, identity hash).

    The inverse of `Store.manifest_uri`: the sidecar gets a manifest URI in the claim annotation.
    """
    m = re.match(r"^(?P<store>.*?)/?archives/(?P<ident>[0-9a-f]{8,64})/manifest$", uri)
    if not m:
        raise StoreError(f"not a manifest URI (…/archives/<identity-hash>/manifest): {uri!r}")
    store = m.group("store")
    if store in ("file:", "file://"):
        store = "file:///"
    return store, m.group("ident")


def open_manifest_uri(uri: str, **opts: Any) -> tuple[Store, str]:
    """Open the store that holds the manifest at `uri`; returns (store, identity hash)."""
    store_uri, identity_hash = split_manifest_uri(uri)
    return open_store(store_uri, **opts), identity_hash


__all__ = [
    "BlobCorrupt",
    "BlobInfo",
    "BlobMissing",
    "BlobWrongSize",
    "HashingWriter",
    "LocalStore",
    "S3Store",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "check_digest",
    "check_hash",
    "check_size",
    "open_manifest_uri",
    "open_store",
    "sha256_bytes",
    "sha256_file",
    "split_manifest_uri",
]
