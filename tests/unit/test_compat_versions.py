"""The compatibility key's triton version is read without importing triton."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from ember.runtime import compat


def test_triton_version_from_package_metadata_without_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    seen: list[str] = []

    def version(dist: str) -> str:
        seen.append(dist)
        if dist == "triton":
            return "3.6.0"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert compat._triton_version() == "3.6.0"
    assert "triton" not in sys.modules and seen == ["triton"]


def test_an_imported_triton_is_asked_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.7.1"))
    assert compat._triton_version() == "3.7.1"


def test_no_triton_anywhere_is_an_empty_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "triton", raising=False)

    def missing(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert compat._triton_version() == ""
