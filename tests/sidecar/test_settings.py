"""Sidecar settings: environment, downward-API fallbacks, CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_sidecar.settings import Settings


def test_env_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "p-1")
    monkeypatch.setenv("POD_NAMESPACE", "ns")
    monkeypatch.setenv("EMBER_SIDECAR_PORT", "0")
    monkeypatch.setenv("EMBER_RUN_DIR", "/tmp/x")
    monkeypatch.setenv("EMBER_STANDALONE", "yes")
    s = Settings.from_env(port=None, archive=None)  # None = flag not given: the env wins
    got = (s.pod_name, s.namespace, s.port, s.run_dir, s.standalone)
    assert got == ("p-1", "ns", 0, Path("/tmp/x"), True)
    assert Settings.from_env(port=1234).port == 1234
    monkeypatch.setenv("EMBER_POD_NAME", "p-2")
    assert Settings.from_env().pod_name == "p-2"


def test_standalone_archive_and_store_options(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings.from_env(store="s3://b/p/", identity="ab" * 32, s3_endpoint="http://127.0.0.1:1")
    assert s.standalone_archive() == f"s3://b/p/archives/{'ab' * 32}/manifest"
    assert s.store_options()["endpoint"] == "http://127.0.0.1:1"
    assert s.cache_options()["s3_chunk"] == 8 << 20
    assert Settings.from_env(archive="file:///a/archives/x/manifest").standalone_archive().startswith("file:")


def test_bad_values_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_SIDECAR_PORT", "99999")
    with pytest.raises(ValueError, match="port"):
        Settings.from_env()
