"""The sidecar against the real local control plane and MinIO.

The sidecar runs as a LOCAL PROCESS standing in for the sidecar container of a kwok pod: the Pod
object exists in the API server, bound to a fake GPU node; the process watches it, the test
patches the operator's claim annotations, and plays the engine through ember.handoff. Checked:
claim → fetch → verify → handoff → metrics and the `ember.dev/restore` annotation; a corrupted
blob, a wrong identity and an S3 outage each give a fallback signal, a Warning event on the pod
and the ModelDeployment, and the right metric, with the process still up; the pod deleted
mid-fetch ends the process cleanly (exit 0, no partial files).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cluster import LocalCluster, LocalMinio, wait_until
from support.sidecar import ThrottledProxy, stop_sidecars

from ember import handoff
from ember.store import Store, open_store
from ember_testing.archives import sample_identity, write_blob_archive

pytestmark = [pytest.mark.k8s, pytest.mark.s3]

NODE = "ember-gpu-h100-0"
DEPLOYMENT = "md-sidecar"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SIZES = [65_536, 2_000_000, 500_000, 6_000_000]


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def pin(store: Store, identity: str) -> str:
    """The manifest digest an operator would pin (zeros when there is no manifest)."""
    data = store.get_manifest(identity)
    return hashlib.sha256(data).hexdigest() if data is not None else "0" * 64


@dataclass
class SidecarPod:
    """A kwok pod object plus the local sidecar process standing in for its sidecar container."""

    core: client.CoreV1Api
    namespace: str
    name: str
    run_dir: Path
    proc: subprocess.Popen[str]

    @property
    def port(self) -> int:
        path = self.run_dir / "sidecar.port"
        return int(wait_until(lambda: path.is_file() and path.read_text(), timeout=30, what="sidecar port"))

    def claim(self, archive_uri: str, identity: str, digest: str) -> None:
        """Claim as the operator does: the manifest URI, the identity and the pinned digest."""
        self.core.patch_namespaced_pod(self.name, self.namespace, {"metadata": {"annotations": {
            "ember.dev/archive": archive_uri, "ember.dev/identity": identity,
            "ember.dev/manifest-digest": digest, "ember.dev/claimed-at": f"{time.time():.6f}"}}})

    def annotation(self) -> str | None:
        pod = self.core.read_namespaced_pod(self.name, self.namespace)
        return (pod.metadata.annotations or {}).get("ember.dev/restore")

    def metric(self, text: str) -> bool:
        return text in http_get(self.port, "/metrics")[1]

    def warnings(self, kind: str, name: str) -> list[Any]:
        evs = self.core.list_namespaced_event(self.namespace).items
        return [e for e in evs if e.type == "Warning" and e.reason == "RestoreFallback"
                and e.involved_object.kind == kind and e.involved_object.name == name]


@pytest.fixture
def bucket_store(minio: LocalMinio, monkeypatch: pytest.MonkeyPatch) -> Store:
    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    return open_store(f"s3://{minio.bucket}/sidecar-{uuid.uuid4().hex[:8]}", endpoint=minio.endpoint)


@pytest.fixture
def sidecar_pod(k8s: LocalCluster, k8s_namespace: str, minio: LocalMinio, tmp_path: Path) -> Iterator[Any]:
    core = client.CoreV1Api(k8s.api_client)
    procs: list[subprocess.Popen[str]] = []

    def make(endpoint: str | None = None, **env: str) -> SidecarPod:
        name = f"serve-{uuid.uuid4().hex[:6]}"
        core.create_namespaced_pod(k8s_namespace, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"ember.dev/pool": "warm",
                                                  "ember.dev/deployment": DEPLOYMENT}},
            "spec": {"nodeName": NODE, "tolerations": [GPU_TOLERATION],
                     "containers": [{"name": "engine", "image": "registry.invalid/ember/engine:1"}]},
        })
        run_dir = tmp_path / name
        full_env = {**os.environ, **minio.env, "KUBECONFIG": str(k8s.kubeconfig),
                    "EMBER_POD_NAME": name, "EMBER_POD_NAMESPACE": k8s_namespace,
                    "EMBER_RUN_DIR": str(run_dir), "EMBER_SIDECAR_PORT": "0",
                    "EMBER_SIDECAR_HOST": "127.0.0.1",  # test servers listen on loopback only
                    "EMBER_FETCH_RETRY_S": "2", "EMBER_S3_MAX_ATTEMPTS": "2",
                    "EMBER_S3_CONNECT_TIMEOUT": "1", "EMBER_S3_READ_TIMEOUT": "5", **env}
        if endpoint:
            full_env["EMBER_S3_ENDPOINT"] = endpoint
        full_env.pop("KUBERNETES_SERVICE_HOST", None)
        proc = subprocess.Popen([sys.executable, "-m", "ember_sidecar.main"], env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        return SidecarPod(core, k8s_namespace, name, run_dir, proc)

    yield make
    stop_sidecars(procs)


def test_claim_fetch_verify_handoff_metrics(sidecar_pod: Any, bucket_store: Store) -> None:
    m = write_blob_archive(bucket_store, SIZES)
    pod = sidecar_pod()
    assert http_get(pod.port, "/livez")[0] == 200
    handoff.report("standby", 1.0, run_dir=pod.run_dir)
    wait_until(lambda: http_get(pod.port, "/readyz")[0] == 200, timeout=10, what="warm pod claimable")

    pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash,
              pin(bucket_store, m.identity_hash))
    res = handoff.wait_for_archive(pod.run_dir, deadline=60)
    assert res.restored, res.reason
    assert http_get(pod.port, "/readyz")[0] == 503, "claimed and not yet serving: not Ready"
    for b in m.blobs:
        assert res.blob_path(b.sha256).stat().st_size == b.compressed_size
    with handoff.load_attempt(res):
        handoff.report("compat", 0.002, run_dir=pod.run_dir)
        handoff.report("load", 0.3, run_dir=pod.run_dir)
    handoff.report("first_token", 0.02, run_dir=pod.run_dir)
    handoff.report("ready", 0.0, run_dir=pod.run_dir)

    wait_until(lambda: pod.annotation() == "restored", timeout=20, what="ember.dev/restore=restored")
    wait_until(lambda: http_get(pod.port, "/readyz")[0] == 200, timeout=10, what="ready")
    _, text = http_get(pod.port, "/metrics")
    assert 'ember_restores_total{reason="",result="restored"} 1.0' in text
    for stage in ("claim_to_fetch", "fetch", "verify", "handoff", "compat", "load", "first_token"):
        assert f'ember_restore_stage_seconds_count{{stage="{stage}"}} 1.0' in text, stage
    assert pod.proc.poll() is None


def _assert_fallback(pod: SidecarPod, reason: str) -> None:
    res = handoff.wait_for_archive(pod.run_dir, deadline=60)
    assert not res.restored and res.reason.startswith(reason), res.reason
    wait_until(lambda: (pod.annotation() or "").startswith(f"fallback: {reason}"), timeout=20,
               what=f"ember.dev/restore=fallback: {reason}")
    wait_until(lambda: pod.warnings("Pod", pod.name), timeout=20, what="Warning event on the pod")
    md_events = wait_until(lambda: pod.warnings("ModelDeployment", DEPLOYMENT), timeout=20,
                           what="Warning event on the ModelDeployment")
    assert reason in md_events[0].message
    assert pod.metric(f'ember_restores_total{{reason="{reason}",result="fallback"}} 1.0')
    time.sleep(0.5)
    assert pod.proc.poll() is None, "the sidecar stays up after a fallback"
    assert http_get(pod.port, "/livez")[0] == 200


def test_corrupted_blob_falls_back(sidecar_pod: Any, bucket_store: Store, minio: LocalMinio) -> None:
    m = write_blob_archive(bucket_store, SIZES)
    key = f"{bucket_store.prefix}/blobs/{m.blobs[1].sha256}"
    minio.client().put_object(Bucket=minio.bucket, Key=key, Body=b"\0" * m.blobs[1].compressed_size)
    pod = sidecar_pod()
    pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash,
              pin(bucket_store, m.identity_hash))
    _assert_fallback(pod, "digest-mismatch")


def test_manifest_replaced_after_the_pin_falls_back(sidecar_pod: Any, bucket_store: Store) -> None:
    """Issue 18 item 2: the claim pins the manifest digest; a manifest swapped since is refused,
    even a consistent one (same identity, valid blobs)."""
    identity = sample_identity(f"swapped-{uuid.uuid4().hex[:6]}")
    m = write_blob_archive(bucket_store, SIZES, identity=identity)
    pinned = pin(bucket_store, m.identity_hash)
    write_blob_archive(bucket_store, SIZES, identity=identity, seed=1)  # replaced in the bucket
    assert pin(bucket_store, m.identity_hash) != pinned
    pod = sidecar_pod()
    pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash, pinned)
    _assert_fallback(pod, "manifest-digest-mismatch")


def test_claim_without_a_pin_falls_back(sidecar_pod: Any, bucket_store: Store) -> None:
    m = write_blob_archive(bucket_store, SIZES)
    pod = sidecar_pod()
    pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash, "")
    _assert_fallback(pod, "claim-invalid")


def test_wrong_identity_falls_back(sidecar_pod: Any, bucket_store: Store) -> None:
    claimed = sample_identity(f"claimed-{uuid.uuid4().hex[:6]}").hash()
    write_blob_archive(bucket_store, SIZES, identity=sample_identity("another"),
                       manifest_identity_hash=claimed)
    pod = sidecar_pod()
    pod.claim(bucket_store.manifest_uri(claimed), claimed, pin(bucket_store, claimed))
    _assert_fallback(pod, "identity-mismatch")


def test_s3_outage_falls_back(sidecar_pod: Any, bucket_store: Store, minio: LocalMinio) -> None:
    m = write_blob_archive(bucket_store, SIZES)
    host, port = minio.endpoint.removeprefix("http://").split(":")
    proxy = ThrottledProxy(host, int(port))
    try:
        proxy.cut()  # MinIO is unreachable for this sidecar
        pod = sidecar_pod(endpoint=proxy.endpoint)
        t0 = time.monotonic()
        pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash,
              pin(bucket_store, m.identity_hash))
        _assert_fallback(pod, "store-unavailable")
        assert time.monotonic() - t0 >= 1.5, "retried for EMBER_FETCH_RETRY_S before falling back"
    finally:
        proxy.close()


def test_pod_deleted_mid_fetch_ends_cleanly(sidecar_pod: Any, bucket_store: Store, minio: LocalMinio) -> None:
    m = write_blob_archive(bucket_store, [65_536, 24_000_000])
    host, port = minio.endpoint.removeprefix("http://").split(":")
    proxy = ThrottledProxy(host, int(port), bytes_per_s=2_000_000)  # ~12 s for the archive
    try:
        pod = sidecar_pod(endpoint=proxy.endpoint)
        pod.claim(bucket_store.manifest_uri(m.identity_hash), m.identity_hash,
              pin(bucket_store, m.identity_hash))
        blobs = pod.run_dir / "store" / "blobs"
        wait_until(lambda: blobs.is_dir() and any(p.name.startswith(".") for p in blobs.iterdir()),
                   timeout=30, what="a partial download in the cache")
        assert (handoff.read_json(pod.run_dir / handoff.STATUS_FILE) or {}).get("state") == "fetching"
        pod.core.delete_namespaced_pod(pod.name, pod.namespace)
        out, _ = pod.proc.communicate(timeout=30)
        assert pod.proc.returncode == 0, out
        assert "stopping" in out
        assert not [p.name for p in blobs.iterdir() if p.name.startswith(".")], "partial files removed"
        assert not (pod.run_dir / "store" / "archives" / m.identity_hash / "manifest").exists()
    finally:
        proxy.close()


def test_warm_pod_prefetch_then_claim_pays_no_download(sidecar_pod: Any, bucket_store: Store,
                                                       minio: LocalMinio) -> None:
    m = write_blob_archive(bucket_store, SIZES)
    other = write_blob_archive(bucket_store, [4096, 100_000], identity=sample_identity("prefetch-other"),
                               seed=3)
    pod = sidecar_pod()
    uris = [bucket_store.manifest_uri(m.identity_hash), bucket_store.manifest_uri(other.identity_hash)]
    pod.core.patch_namespaced_pod(pod.name, pod.namespace, {"metadata": {"annotations": {
        "ember.dev/prefetch": ",".join(uris)}}})
    wait_until(lambda: pod.metric('ember_prefetches_total{result="ok"} 2.0'), timeout=30, what="prefetches")
    # The store loses the blobs: a claim can only succeed from the pod's cache.
    for b in m.blobs:
        minio.client().delete_object(Bucket=minio.bucket, Key=f"{bucket_store.prefix}/blobs/{b.sha256}")
    pod.claim(uris[0], m.identity_hash, pin(bucket_store, m.identity_hash))
    res = handoff.wait_for_archive(pod.run_dir, deadline=30)
    assert res.restored, res.reason
    assert pod.metric('ember_restore_stage_seconds_sum{stage="fetch"} 0.0')
