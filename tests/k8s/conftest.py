"""Fixtures shared by the operator's k8s tests."""

from __future__ import annotations

import pytest
from operator_harness import install_crds
from support.cluster import LocalCluster


@pytest.fixture(scope="module")
def crds(k8s: LocalCluster) -> None:
    install_crds(k8s)
