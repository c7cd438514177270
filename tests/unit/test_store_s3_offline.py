"""S3Store failures that need no server: unreachable endpoints and missing credentials end in
StoreUnavailable, with a reason, within a bounded time (loopback only)."""

from __future__ import annotations

import socket
import time

import pytest

from ember.store import StoreError, StoreUnavailable, open_store


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_is_unavailable_within_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_S3_ENDPOINT", raising=False)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    store = open_store("s3://bucket/prefix", endpoint=endpoint, access_key="k", secret_key="s",
                       max_attempts=3, connect_timeout=1, read_timeout=2)
    calls = [store.check, lambda: store.get_manifest("ab" * 32), lambda: store.has_blob("cd" * 32),
             lambda: store.put_blob(b"payload"), store.list_archives]
    for call in calls:
        t = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"cannot reach s3://bucket/prefix \(endpoint http://127"):
            call()
        assert time.monotonic() - t < 20


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("EMBER_S3_ENDPOINT", endpoint)
    store = open_store("s3://b", access_key="k", secret_key="s", max_attempts=1)
    assert store.endpoint == endpoint  # type: ignore[attr-defined]
    with pytest.raises(StoreUnavailable, match=endpoint):
        store.check()


def test_missing_credentials_say_what_to_set(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store("s3://b/p", endpoint=f"http://127.0.0.1:{closed_port()}", max_attempts=1)
    with pytest.raises(StoreUnavailable, match="no S3 credentials"):
        store.check()


def test_bad_retry_mode_is_refused() -> None:
    from ember.store import StoreError

    with pytest.raises(StoreError, match="retry_mode"):
        open_store("s3://b", endpoint="http://127.0.0.1:9", retry_mode="sometimes")


def test_endpoint_without_host_is_a_store_error() -> None:
    """`http://` (no host) was an uncaught ValueError from botocore: the operator's archive
    reconcile crashed and retried every 5 s. Now a StoreError with the setting named."""
    with pytest.raises(StoreError, match=r"invalid S3 settings \(endpoint 'http://'\)"):
        open_store("s3://bucket/prefix", endpoint="http://", access_key="k", secret_key="s",
                   region="us-east-1")
