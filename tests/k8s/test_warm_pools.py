"""Identity-keyed warm pools on the local control plane (issue 37, control-plane half).

The operator runs as a local process; kwok runs the pods' containers as stand-ins. For the pod
whose engine protocol is under test the sidecar runs as a LOCAL PROCESS watching its kwok pod
(as in test_sidecar.py) and this test plays the engine through `ember.handoff`: it gets the
archive before any claim, says it is loaded (`engine_ready`) and waits for the claim
(`wait_for_claim`). Other warm pods' engine state is written as the sidecar would write it
(`ember.dev/engine`). Checked: warm pods per deployment and archive, created with the hand-off
data; only engine-ready ones are claimed; the claim puts the pod into the Service's endpoints;
replacement on a new manifest digest, on edited engine arguments and on a crashed engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    COMPAT,
    Api,
    OperatorProcess,
    identity_of,
    md_spec,
    operator_env,
    wait_for,
    write_test_archive,
)
from support.cluster import LocalCluster, LocalMinio
from support.sidecar import stop_sidecars

from ember import handoff
from ember.archive.bundle import write_archive
from ember.store import open_store
from ember_testing.synthetic import synthetic_graphset, synthetic_images

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "warm37") as env:
        yield env


@pytest.fixture
def sidecars(k8s: LocalCluster, minio: LocalMinio, tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(namespace: str, pod: str) -> tuple[Path, int]:
        run_dir = tmp_path / pod
        env = {**os.environ, **minio.env, "KUBECONFIG": str(k8s.kubeconfig), "EMBER_POD_NAME": pod,
               "EMBER_POD_NAMESPACE": namespace, "EMBER_RUN_DIR": str(run_dir), "EMBER_SIDECAR_PORT": "0",
               "EMBER_SIDECAR_HOST": "127.0.0.1", "EMBER_S3_ENDPOINT": minio.endpoint}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "ember_sidecar.main"], env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        port_file = run_dir / "sidecar.port"
        port = int(wait_for(lambda: port_file.is_file() and port_file.read_text(), "sidecar port"))
        return run_dir, port

    yield start
    stop_sidecars(procs)


def _bound(api: Api, md: str) -> list[Any]:
    return sorted(api.pods(f"ember.dev/pool=warm,ember.dev/warm-for={md}"), key=lambda p: p.metadata.name)


def _ann(pod: Any) -> dict[str, str]:
    return dict(pod.metadata.annotations or {})


def _engine(api: Api, pod: str, value: str) -> None:
    """What the pod's sidecar writes for its engine (ember.dev/engine)."""
    api.core.patch_namespaced_pod(pod, api.ns, {"metadata": {"annotations": {"ember.dev/engine": value}}})


def _endpoints(api: Api, service: str) -> set[str]:
    out = api.k8s.kubectl("get", "endpointslices", "-n", api.ns, "-l",
                          f"kubernetes.io/service-name={service}", "-o", "json").stdout
    return {ep["targetRef"]["name"] for item in json.loads(out)["items"] for ep in item.get("endpoints") or []
            if (ep.get("conditions") or {}).get("ready") and ep.get("targetRef")}


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_warm_pods_carry_the_hand_off_and_only_ready_engines_are_claimed_into_service(
    env: Any, sidecars: Any, minio: LocalMinio,
) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=0, warmPool={"size": 2}, engine={
        "kind": "transformers", "version": "4.57.0", "image": "registry.invalid/ember/engine:test",
        "args": ["--max-tokens-limit", "256"]})
    serve_args = ["--model", "Qwen/Qwen3-0.6B", "--max-tokens-limit", "256"]  # its pods' `ember serve`
    write_test_archive(minio, prefix, spec)
    api.create_md("qwen", spec)
    ga = wait_for(lambda: (a := api.archives()) and (a[0].get("status") or {}).get("digest") and a[0],
                  "archive Available", op)
    pods = wait_for(lambda: len(b := _bound(api, "qwen")) == 2 and all(p.spec.node_name for p in b) and b,
                    "two scheduled identity-keyed warm pods", op)
    for pod in pods:
        ann, labels = _ann(pod), pod.metadata.labels
        assert ann["ember.dev/archive"] == ga["status"]["uri"]
        assert ann["ember.dev/manifest-digest"] == ga["status"]["digest"]
        assert ann["ember.dev/identity"] == identity_of(spec).hash() == ga["spec"]["identityHash"]
        assert json.loads(ann["ember.dev/identity-spec"])["model"] == "Qwen/Qwen3-0.6B"
        assert json.loads(ann["ember.dev/engine-args"]) == serve_args
        assert pod.spec.containers[0].command[-4:] == serve_args
        assert (ann["ember.dev/rank"], ann["ember.dev/world"]) == ("0", "1")
        assert "ember.dev/claimed-at" not in ann and "ember.dev/deployment" not in labels
        assert pod.metadata.owner_references[0].name == "qwen"

    # Pod A: a real sidecar fetches and verifies before any claim; the engine loads and is idle.
    a, b = pods[0].metadata.name, pods[1].metadata.name
    run_dir, port = sidecars(api.ns, a)
    result = handoff.wait_for_archive(run_dir, deadline=60)
    assert result.restored and result.warm, result.reason
    assert list(result.engine_args) == serve_args
    wait_for(lambda: _ann(api.core.read_namespaced_pod(a, api.ns)).get("ember.dev/engine") == "loading",
             "the sidecar reports the engine loading", op)
    assert _readyz(port) == 503
    handoff.engine_ready(result)
    wait_for(lambda: _ann(api.core.read_namespaced_pod(a, api.ns)).get("ember.dev/engine") == "ready",
             "the sidecar reports the engine ready", op)
    assert _readyz(port) == 200, "Ready: out of service by its labels, not by its probe"
    _engine(api, b, "loading")  # pod B: still loading
    status = wait_for(lambda: (s := api.md("qwen").get("status") or {}).get("warmReady") == 1 and s,
                      "status counts one ready warm engine", op)
    assert status["warmLoading"] == 1 and status["replicas"] == 0
    assert a not in _endpoints(api, "qwen"), "a warm pod is not in the deployment's Service"
    assert handoff.wait_for_claim(run_dir, timeout=0.2) is None

    api.k8s.kubectl("scale", "-n", api.ns, "md/qwen", "--replicas=2")
    serving = wait_for(lambda: len(s := api.serving("qwen")) == 2 and s, "two serving pods", op)
    names = {p.metadata.name for p in serving}
    assert a in names and b not in names, "only the engine-ready warm pod is claimed; a cold pod instead of B"
    claimed = handoff.wait_for_claim(run_dir, timeout=30)
    assert claimed is not None and claimed.claimed_at > 0
    wait_for(lambda: a in _endpoints(api, "qwen"), "the claimed pod in the Service's endpoints", op)
    assert b in {p.metadata.name for p in _bound(api, "qwen")}, "B stays warm (loading)"
    wait_for(lambda: len(_bound(api, "qwen")) == 2, "the pool topped back up", op)


def test_warm_pods_are_replaced_on_a_new_digest_new_engine_args_and_a_crashed_engine(
    env: Any, minio: LocalMinio,
) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, replicas=0, warmPool={"size": 1}, engine={  # vLLM: a non-graph argument
        "kind": "vllm", "version": "0.26.0", "image": "registry.invalid/ember/engine:test"})
    write_test_archive(minio, prefix, spec)
    api.create_md("qwen", spec)
    first = wait_for(lambda: len(b := _bound(api, "qwen")) == 1 and b[0], "one warm pod", op)
    _engine(api, first.metadata.name, "ready")

    # A crashed engine (its sidecar says failed): replaced by a new pod of the same pool.
    _engine(api, first.metadata.name, "failed: engine exited (signal 9)")
    second = wait_for(lambda: len(b := _bound(api, "qwen")) == 1 and b[0].metadata.uid != first.metadata.uid
                      and b[0], "the crashed warm pod replaced", op)
    assert "ember.dev/engine" not in _ann(second)
    assert second.metadata.labels["ember.dev/pool-key"] == first.metadata.labels["ember.dev/pool-key"]
    _engine(api, second.metadata.name, "ready")

    # Edited engine arguments (not identity: same archive): a new pool, the old pod deleted.
    api.patch_md("qwen", {"spec": {"engine": {"args": ["--served-model-name", "q2"]}}})
    third = wait_for(lambda: len(b := _bound(api, "qwen")) == 1 and b[0].metadata.uid != second.metadata.uid
                     and b[0], "replaced after the engine args edit", op)
    assert json.loads(_ann(third)["ember.dev/engine-args"])[-2:] == ["--served-model-name", "q2"]
    assert _ann(third)["ember.dev/manifest-digest"] == _ann(second)["ember.dev/manifest-digest"]
    _engine(api, third.metadata.name, "ready")

    # The manifest replaced in the store (new digest): warm pods of the old digest go, never claimed.
    store = open_store(f"s3://{minio.bucket}/{prefix}", endpoint=minio.endpoint, region=minio.region,
                       access_key=minio.access_key, secret_key=minio.secret_key)
    write_archive(store, synthetic_graphset(graphs=3, nodes=20, groups=1), identity_of(spec), COMPAT,
                  kernel_images=synthetic_images())
    old_digest = _ann(third)["ember.dev/manifest-digest"]
    fourth = wait_for(lambda: len(b := _bound(api, "qwen")) == 1 and b[0].metadata.uid != third.metadata.uid
                      and b[0], "replaced after the manifest changed", op, timeout=90)
    new_digest = _ann(fourth)["ember.dev/manifest-digest"]
    assert new_digest != old_digest
    assert (api.archives()[0]["status"]["digest"]) == new_digest
    # Its engine not ready yet: a scale-up makes a cold pod rather than claim it.
    api.k8s.kubectl("scale", "-n", api.ns, "md/qwen", "--replicas=1")
    serving = wait_for(lambda: len(s := api.serving("qwen")) == 1 and s, "one serving pod", op)
    assert serving[0].metadata.name != fourth.metadata.name
    assert _ann(serving[0])["ember.dev/manifest-digest"] == new_digest
