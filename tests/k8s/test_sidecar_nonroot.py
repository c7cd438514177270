"""The sidecar against the API server and MinIO as its container runs it: UID 65532, every capability
dropped, no_new_privs, `/` read-only except its run dir and /tmp (tests/support/confine.py), and
the serving pods' own identity: a token of the chart's `ember-pod` ServiceAccount (pod-rbac.yaml,
rendered by helm for the test namespace) instead of the admin kubeconfig. It still claims, fetches,
verifies, hands off and writes the restore result on its pod."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from sa_identity import apply_docs, render, token_kubeconfig
from support.cluster import LocalCluster, LocalMinio, wait_until
from support.confine import UID, confined, sidecar_env, unshare_works

from ember import handoff
from ember.store import open_store
from ember_testing.archives import write_blob_archive

pytestmark = [pytest.mark.k8s, pytest.mark.s3,
              pytest.mark.skipif(not unshare_works(), reason="needs root and mount namespaces (unshare)")]

NODE = "ember-gpu-h100-0"
# The engine's side of the hand-off, run as the sidecar's UID: LOAD reported, then ready.
ENGINE = """
import sys
from pathlib import Path
from ember import handoff
run_dir = Path(sys.argv[1])
res = handoff.wait_for_archive(run_dir, deadline=30)
assert res.restored, res.reason
with handoff.load_attempt(res):
    handoff.report("load", 0.1, run_dir=run_dir)
handoff.report("ready", 0.0, run_dir=run_dir)
"""
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ember-nonroot-k8s-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_claim_fetch_verify_handoff_as_non_root(
    k8s: LocalCluster, k8s_namespace: str, minio: LocalMinio, base: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{minio.bucket}/nonroot-{uuid.uuid4().hex[:8]}", endpoint=minio.endpoint)
    m = write_blob_archive(store, [65_536, 2_000_000, 500_000])
    digest = hashlib.sha256(store.get_manifest(m.identity_hash) or b"").hexdigest()

    # The pod's identity: the chart's pod ServiceAccount + Role in this namespace, a token of it.
    apply_docs(k8s, render(["templates/pod-rbac.yaml"], namespace=k8s_namespace,
                           sets=(f"workloadNamespaces={{{k8s_namespace}}}",)))
    core = client.CoreV1Api(k8s.api_client)
    name = f"serve-{uuid.uuid4().hex[:6]}"
    labels = {"ember.dev/pool": "warm", "ember.dev/deployment": "md-nonroot"}
    pod_body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": NODE, "tolerations": [GPU_TOLERATION], "serviceAccountName": "ember-pod",
                 "automountServiceAccountToken": False,
                 "containers": [{"name": "engine", "image": "registry.invalid/ember/engine:1"}]},
    }
    pod = core.create_namespaced_pod(k8s_namespace, pod_body)
    token_dir = base / "sa"  # the read-only token volume: a token bound to this pod
    kubeconfig = token_kubeconfig(k8s, "ember-pod", k8s_namespace, token_dir / "kubeconfig", bound_pod=pod)
    token_dir.chmod(0o755)
    kubeconfig.chmod(0o644)
    run_dir, tmp = base / "run", base / "tmp"
    env = sidecar_env(tmp, tmp, KUBECONFIG=str(kubeconfig), EMBER_POD_NAME=name,
                      EMBER_POD_NAMESPACE=k8s_namespace, EMBER_RUN_DIR=str(run_dir), EMBER_SIDECAR_PORT="0",
                      EMBER_SIDECAR_HOST="127.0.0.1", EMBER_LOG_LEVEL="INFO", **minio.env)
    proc = subprocess.Popen(confined([sys.executable, "-m", "ember_sidecar.main"], writable=[run_dir, tmp]),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (run_dir / "sidecar.port").is_file(), timeout=30, what="sidecar port")
        core.patch_namespaced_pod(name, k8s_namespace, {"metadata": {"annotations": {
            "ember.dev/archive": store.manifest_uri(m.identity_hash), "ember.dev/identity": m.identity_hash,
            "ember.dev/manifest-digest": digest, "ember.dev/claimed-at": f"{time.time():.6f}"}}})
        res = handoff.wait_for_archive(run_dir, deadline=60)
        if not res.restored:
            proc.send_signal(signal.SIGTERM)
            pytest.fail(f"{res.reason}; sidecar output:\n{proc.communicate(timeout=30)[0][-4000:]}")
        for b in m.blobs:
            path = res.blob_path(b.sha256)
            assert path.stat().st_size == b.compressed_size and path.stat().st_uid == UID
        # The engine shares the UID (the pods run both containers as 65532): its reports, written
        # as that UID from the same confined namespace, are what the sidecar reads.
        engine = subprocess.run(confined([sys.executable, "-c", ENGINE, str(run_dir)], writable=[run_dir]),
                                env=sidecar_env(tmp, tmp), capture_output=True, text=True, timeout=60)
        assert engine.returncode == 0, engine.stderr

        def annotation() -> str | None:
            pod = core.read_namespaced_pod(name, k8s_namespace)
            return (pod.metadata.annotations or {}).get("ember.dev/restore")

        try:
            wait_until(lambda: annotation() == "restored", timeout=20, what="ember.dev/restore=restored")
        except pytest.fail.Exception as exc:
            proc.send_signal(signal.SIGTERM)
            pytest.fail(f"{exc}; sidecar output:\n{proc.communicate(timeout=30)[0][-4000:]}")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    for bad in ("Read-only file system", "Permission denied", "Forbidden", "forbidden"):
        assert bad not in out, out
