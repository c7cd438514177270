"""Shared pytest set-up: tier markers and the GPU gate.

Tiers: unit tests run everywhere; `k8s` and `s3` tests run against the real local control
plane and MinIO (fixtures in tests/fixtures_cluster.py); `gpu` tests run only where a GPU is
present and are skipped elsewhere with a visible reason.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

# Session fixtures `k8s`, `k8s_namespace`, `minio` (real local servers via e2e/cluster.sh up).
from fixtures_cluster import k8s, k8s_namespace, local_cluster_env, minio  # noqa: F401


@functools.cache
def gpu_available() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="gpu: no NVIDIA GPU on this machine (run on a GPU machine, see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
