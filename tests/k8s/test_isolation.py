"""One ModelDeployment's fault stays its own: a warm pool the apiserver refuses (here: a LimitRange
caps the CPU a container may ask for) must not stop the other pools of the namespace."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from operator_harness import Api, OperatorProcess, md_spec, operator_env, wait_for, write_test_archive
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "opiso") as env:
        yield env


def _pool(api: Api, image: str) -> list[Any]:
    return [p for p in api.warm() if p.spec.containers[0].image == image]


def test_a_refused_warm_pool_does_not_stop_the_others(
    env: tuple[Api, OperatorProcess, str], minio: LocalMinio,
) -> None:
    api, op, prefix = env
    api.core.create_namespaced_limit_range(api.ns, client.V1LimitRange(
        metadata=client.V1ObjectMeta(name="cpu-cap"),
        spec=client.V1LimitRangeSpec(limits=[client.V1LimitRangeItem(type="Container", max={"cpu": "8"})]),
    ))
    good_image, bad_image = "registry.invalid/ember/good:1", "registry.invalid/ember/bad:1"
    # The bad deployment asks for more CPU than the LimitRange allows: its warm pods are refused.
    bad = md_spec(minio, prefix, replicas=0, warmPool={"size": 2})
    write_test_archive(minio, prefix, bad)  # one identity for both (no SAVE): identity-keyed pools
    bad["engine"] = {**bad["engine"], "image": bad_image, "resources": {"requests": {"cpu": "64"}}}
    api.create_md("bad", bad)
    good = md_spec(minio, prefix, replicas=0, warmPool={"size": 2})
    good["engine"] = {**good["engine"], "image": good_image}
    api.create_md("good", good)
    wait_for(lambda: len(_pool(api, good_image)) == 2, "the good pool filled", op)

    # Shrinking the good pool must drain it although the bad pool keeps failing.
    api.patch_md("good", {"spec": {"warmPool": {"size": 1}}})
    wait_for(lambda: len(_pool(api, good_image)) == 1, "the good pool drained to 1", op)
    assert _pool(api, bad_image) == []
    reasons = {e.get("reason") for e in api.events_for("bad")}
    assert "WarmPoolRefused" in reasons, reasons
    assert "WarmPoolRefused" not in {e.get("reason") for e in api.events_for("good")}


def test_warm_pool_is_capped_at_max_replicas(
    env: tuple[Api, OperatorProcess, str], minio: LocalMinio,
) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 20},
                   autoscaling={"minReplicas": 1, "maxReplicas": 2})
    api.create_md("capped", spec)
    wait_for(lambda: "WarmPoolCapped" in {e.get("reason") for e in api.events_for("capped")},
             "a WarmPoolCapped warning", op)
    wait_for(lambda: len(api.warm()) >= 1, "warm pods", op)
    # Claims take warm pods too; the pool never holds more than maxReplicas.
    for _ in range(8):
        assert len(api.warm()) <= 2
        time.sleep(0.5)


def test_unplaceable_specs_say_so_in_status(
    env: tuple[Api, OperatorProcess, str], minio: LocalMinio,
) -> None:
    api, op, prefix = env
    api.create_md("nogpu", md_spec(minio, prefix, gpu={"product": "NVIDIA-NO-SUCH-GPU"}))
    api.create_md("nopvc", md_spec(minio, prefix, store={"local": {
        "path": "/var/lib/ember/nopvc", "persistentVolumeClaim": "no-such-claim"}}))
    for name, reason in (("nogpu", "GpuProductUnavailable"), ("nopvc", "PersistentVolumeClaimMissing")):
        cond = wait_for(lambda n=name: api.condition(n, "Schedulable") or None, f"{name} Schedulable", op)
        assert cond["status"] == "False" and cond["reason"] == reason, cond
        # kopf posts events from its own queue: the Warning may land just after the status patch
        wait_for(lambda n=name, r=reason: r in {e.get("reason") for e in api.events_for(n)},
                 f"a {reason} Warning on {name}", op)
    # A placeable deployment reads Schedulable=True.
    api.create_md("fine", md_spec(minio, prefix))
    cond = wait_for(lambda: api.condition("fine", "Schedulable") or None, "fine Schedulable", op)
    assert cond["status"] == "True", cond
