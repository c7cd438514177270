"""Shared pytest set-up: tier markers and the GPU gate.

Tiers: unit tests run everywhere; `k8s` and `s3` tests run against the real local control
plane and MinIO (fixtures in tests/support/cluster.py); `gpu` tests run only where a GPU is
present and are skipped elsewhere with a visible reason. With EMBER_REQUIRE_GPU=1 (a GPU run, the
device tier) every skip of a GPU test (no nvidia-smi, no libember, no torch, ...) is a failure, so
the GPU tier cannot go green while testing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Session fixtures `k8s`, `k8s_namespace`, `minio` (real local servers via e2e/cluster.sh up).
from support.cluster import k8s, k8s_namespace, local_cluster_env, minio  # noqa: F401
from support.gpu_gate import REQUIRE_GPU_ENV, gpu_available, gpu_required

GPU_TESTS = Path(__file__).parent / "gpu"


def _is_gpu_test(item: pytest.Item | pytest.Collector) -> bool:
    path = Path(str(getattr(item, "path", "") or ""))
    return "gpu" in item.keywords or GPU_TESTS in path.parents or path == GPU_TESTS


def _skip_to_failure(report: pytest.TestReport | pytest.CollectReport, where: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_GPU_ENV}=1 and a GPU test was skipped ({where}): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and gpu_required() and _is_gpu_test(item) and not hasattr(report, "wasxfail"):
        _skip_to_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    # A module-level pytest.importorskip("torch") skips the whole module at collection.
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and gpu_required() and _is_gpu_test(collector):
        _skip_to_failure(report, collector.nodeid)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    # Under EMBER_REQUIRE_GPU=1 this skip becomes a failure (pytest_runtest_makereport above).
    skip = pytest.mark.skip(reason="gpu: no NVIDIA GPU on this machine (run on a GPU machine, see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
