"""No ember object holds a finalizer, so a namespace can be deleted while no operator runs (its
pods, HPAs and SAVE Jobs go with it through owner references)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from operator_harness import Api, OperatorProcess, md_spec, wait_for
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


def _gone(api: Api) -> bool:
    try:
        api.core.read_namespace(api.ns)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_namespace_deletion_completes_with_no_operator_running(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    ns = k8s.create_namespace("opfin")
    api = Api(k8s, ns)
    api.create_secret("ember-s3", minio)
    op = OperatorProcess(kubeconfig=k8s.kubeconfig, namespace=ns, log_path=tmp_path / "operator.log").start()
    try:
        api.create_md("fin", md_spec(minio, f"fin-{ns}", replicas=1, warmPool={"size": 1}))
        wait_for(lambda: api.archives() and api.jobs() and api.serving("fin"), "archive, SAVE Job, pod", op)
        time.sleep(7)  # past a resync interval (5 s): nothing it does may add a finalizer either
        for obj in [api.md("fin"), *api.archives()]:
            assert not obj["metadata"].get("finalizers"), obj["metadata"]
    finally:
        op.stop()
    k8s.delete_namespace(ns)  # no api.release(): nothing is left for anyone to release
    wait_for(lambda: _gone(api), "the namespace deleted without an operator", timeout=90, interval=1)
