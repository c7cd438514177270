"""Binaries e2e/build.sh builds from Go module sources, for unit tests that run them.

`built("promtool", "PROMETHEUS_VERSION", "EMBER_PROMTOOL")` is e2e/.work/bin/promtool-<version>/
promtool (EMBER_E2E_WORK moves e2e/.work; the environment variable names another binary). CI
builds them before the tests (.ci/run's go-build stage), so there a missing one fails the test;
elsewhere the test skips with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def versions() -> dict[str, str]:
    lines = (REPO / "e2e" / "versions.env").read_text().splitlines()
    pairs = (line.split("#")[0].strip() for line in lines)
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def built(binary: str, version_key: str, env_var: str) -> str:
    if env := os.environ.get(env_var):
        return env
    work = Path(os.environ.get("EMBER_E2E_WORK", REPO / "e2e" / ".work"))
    path = work / "bin" / f"{binary}-{versions()[version_key]}" / binary
    if path.exists():
        return str(path)
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{binary} not built at {path} (e2e/build.sh builds it before the tests)", pytrace=False)
    pytest.skip(f"{binary} not built ({path}; e2e/build.sh {binary}, or {env_var})")
