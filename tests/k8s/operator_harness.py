"""Helpers for the operator's k8s tests: CRDs, the operator as a subprocess, archives in MinIO.

The operator runs as a LOCAL PROCESS (`python -m ember_operator.main`) against the local control
plane, watching one test namespace (so tests do not see each other's objects). Pods it creates
are run by kwok on fake GPU nodes; SAVE Job pods are completed by kwok (exit code and termination
message come from the `kwok.ember.dev/*` pod annotations, set through spec.save.podAnnotations).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from sa_identity import assert_no_forbidden, operator_kubeconfig
from support.cluster import REPO, LocalCluster, LocalMinio, wait_until

from ember.archive.bundle import write_archive
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import open_store
from ember_operator.api import ModelDeploymentSpec
from ember_testing.cluster import EngineStandIn, fake_gpu_nodes, kubectl_apply
from ember_testing.synthetic import synthetic_graphset, synthetic_images

GROUP, VERSION = "ember.dev", "v1alpha1"
CRD_FILES = sorted((REPO / "crds").glob("*.yaml"))
PRODUCT = "NVIDIA-H100-80GB-HBM3"  # the cluster's own fake H100 nodes (16 GPUs)
TEST_PRODUCT = "NVIDIA-EMBER-TEST"  # this suite's own kwok nodes, roomy enough for scale tests
COMPAT = CompatKey(gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", driver="580.0", cuda="13.0")


def install_crds(k8s: LocalCluster) -> None:
    """CRDs from crds/ (server-side apply) plus this suite's kwok GPU nodes; waits for Established."""
    kubectl_apply(str(k8s.kubeconfig), fake_gpu_nodes("ember-optest-gpu", TEST_PRODUCT, count=1, gpus=256))
    for path in CRD_FILES:
        k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    names = [f"modeldeployments.{GROUP}", f"grapharchives.{GROUP}"]
    for name in names:
        k8s.kubectl("wait", "--for", "condition=established", f"crd/{name}", "--timeout=60s")


def ensure_priority_class(k8s: LocalCluster, name: str, value: int = -10) -> None:
    """A low, non-preempting PriorityClass as the chart installs them (cluster-scoped: created once)."""
    sched = client.SchedulingV1Api(k8s.api_client)
    body = client.V1PriorityClass(metadata=client.V1ObjectMeta(name=name), value=value,
                                  preemption_policy="Never", description="ember tests")
    try:
        sched.create_priority_class(body)
    except ApiException as exc:
        if exc.status != 409:
            raise


@contextmanager
def chart_objects(k8s: LocalCluster, release: str, template: str, *sets: str,
                  namespace: str = "default") -> Iterator[Path]:
    """The chart's `templates/<template>` rendered by helm (`--set` each of `sets`) and applied;
    deleted again on exit."""
    helm = os.environ.get("EMBER_E2E_HELM") or str(REPO / "e2e/.work/bin/helm-v4.3.1/helm")
    args = [helm, "template", release, str(REPO / "charts/ember"), "--namespace", namespace,
            "--show-only", f"templates/{template}"]
    for value in sets:
        args += ["--set", value]
    path = REPO / "e2e" / ".work" / f"{release}-{template}"
    path.write_text(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    try:
        k8s.kubectl("apply", "-f", str(path))
        yield path
    finally:
        k8s.kubectl("delete", "--ignore-not-found", "-f", str(path), check=False)
        path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class OperatorProcess:
    kubeconfig: Path
    namespace: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0

    def start(self) -> OperatorProcess:
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "EMBER_OPERATOR_NAMESPACES": self.namespace,
            "EMBER_OPERATOR_STANDALONE": "true",
            "EMBER_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "EMBER_OPERATOR_METRICS_HOST": "127.0.0.1",  # test servers listen on loopback only
            "EMBER_OPERATOR_SIDECAR_IMAGE": "registry.invalid/ember/ember:test",
            "EMBER_OPERATOR_RESYNC_SECONDS": "5",
            "EMBER_OPERATOR_SAVE_BACKOFF_SECONDS": "2",
            "EMBER_OPERATOR_WARM_BACKOFF_SECONDS": "1",  # failing warm pools: tests/k8s/test_warm_failing.py
            "EMBER_OPERATOR_MANIFEST_GRACE_SECONDS": "20",
            "EMBER_OPERATOR_STORE_PROBE_TIMEOUT_SECONDS": "1",
            # Stores on loopback only (MinIO and the tests' relays, any port): tests/k8s/test_tenancy.py
            # narrows it to check the allow-list itself.
            "EMBER_OPERATOR_STORE_ENDPOINTS": "http://127.0.0.1",
            **self.env,
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember_operator.main"], env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=str(REPO),
        )
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizers released, exactly like a node loss."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Api:
    """Thin typed access to the objects the tests look at."""

    def __init__(self, k8s: LocalCluster, namespace: str) -> None:
        self.k8s = k8s
        self.ns = namespace
        self.custom = client.CustomObjectsApi(k8s.api_client)
        self.core = client.CoreV1Api(k8s.api_client)
        self.batch = client.BatchV1Api(k8s.api_client)
        self.hpa = client.AutoscalingV2Api(k8s.api_client)
        self.engines: EngineStandIn | None = None  # play_ready_engines

    def create_md(self, name: str, spec: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment",
                "metadata": {"name": name}, "spec": spec}
        kwargs = {"dry_run": "All"} if dry_run else {}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, "modeldeployments", body,
                                                           **kwargs)

    def release(self) -> None:
        """Teardown without a running operator: drop the cleanup finalizers so the namespace can go."""
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, "modeldeployments")
        for md in listed["items"]:
            if md["metadata"].get("finalizers"):
                self.patch_md(md["metadata"]["name"], {"metadata": {"finalizers": None}})

    def md(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "modeldeployments", name)

    def patch_md(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, "modeldeployments", name,
                                                          patch)

    def delete_md(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, "modeldeployments", name)

    def archives(self) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, "grapharchives")["items"]

    def archive(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "grapharchives", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def jobs(self) -> list[Any]:
        return self.batch.list_namespaced_job(self.ns, label_selector="ember.dev/archive").items

    def pods(self, selector: str) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]

    def serving(self, md: str) -> list[Any]:
        return self.pods(f"ember.dev/deployment={md},ember.dev/pool=serving")

    def warm(self) -> list[Any]:
        return self.pods("ember.dev/pool=warm")

    def claimable(self) -> list[Any]:
        """Warm pods the operator may claim: their engine reports ready (see play_ready_engines)."""
        return [p for p in self.warm() if (p.metadata.annotations or {}).get("ember.dev/engine") == "ready"]

    def events_for(self, name: str) -> list[dict[str, Any]]:
        """Events about `name` (raw JSON: the typed client rejects events without eventTime)."""
        resp = self.core.list_namespaced_event(self.ns, _preload_content=False)
        items = json.loads(resp.data)["items"]
        return [e for e in items if (e.get("involvedObject") or {}).get("name") == name]

    def events_for_kind(self, kind: str) -> list[dict[str, Any]]:
        """Events about objects of `kind` in the namespace (those of deleted pods too)."""
        resp = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.kind={kind}",
                                               _preload_content=False)
        return list(json.loads(resp.data)["items"])

    def create_secret(self, name: str, minio: LocalMinio) -> None:
        data = {"AWS_ACCESS_KEY_ID": minio.access_key, "AWS_SECRET_ACCESS_KEY": minio.secret_key}
        self.core.create_namespaced_secret(self.ns, client.V1Secret(
            metadata=client.V1ObjectMeta(name=name),
            data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        ))

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for cond in (self.md(name).get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return cond
        return {}


def play_ready_engines(api: Api) -> EngineStandIn:
    """From now on until the test's namespace goes, identity-keyed warm pods report a ready engine
    once scheduled (tests that claim warm pods on kwok call this first)."""
    if api.engines is None:
        api.engines = EngineStandIn(api.k8s.kubeconfig, api.ns).__enter__()
    return api.engines


@contextmanager
def operator_env(
    k8s: LocalCluster, minio: LocalMinio, log_dir: Path, name: str, env: dict[str, str] | None = None,
    kubeconfig: Path | None = None,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    """A fresh namespace with the S3 secret and an operator watching it; yields (api, operator,
    a unique store prefix). Everything is stopped and deleted on exit; with a restricted operator
    identity, any request RBAC refused fails the test. Warm pods' engines: `play_ready_engines`."""
    ns = k8s.create_namespace(name)
    api = Api(k8s, ns)
    api.create_secret("ember-s3", minio)
    # The admin kubeconfig, or the chart's ServiceAccount token (EMBER_TEST_OPERATOR_KUBECONFIG=sa).
    kubeconfig = kubeconfig or operator_kubeconfig(k8s)
    op = OperatorProcess(kubeconfig=kubeconfig, namespace=ns, log_path=log_dir / "operator.log",
                         env=env or {}).start()
    try:
        yield api, op, f"{name}-{uuid.uuid4().hex[:8]}"
    finally:
        if api.engines is not None:
            api.engines.__exit__()
        op.stop()
        api.release()
        k8s.delete_namespace(ns)
    if kubeconfig != k8s.kubeconfig:
        assert_no_forbidden(op.log_path)


def md_spec(minio: LocalMinio, prefix: str, product: str = TEST_PRODUCT, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen3-0.6B"},
        "engine": {"kind": "transformers", "version": "4.57.0",
                   "image": "registry.invalid/ember/engine:test"},
        "capture": {"sizes": [1, 2, 4, 8], "maxBatch": 8, "maxNumTokens": 2048},
        "gpu": {"product": product},
        "replicas": 2,
        "store": {"s3": {"bucket": minio.bucket, "prefix": prefix, "endpoint": minio.endpoint,
                         "region": minio.region, "credentialsSecret": "ember-s3"}},
    }
    spec.update(over)
    return spec


def identity_of(spec: dict[str, Any]) -> ArchiveIdentity:
    return ModelDeploymentSpec.model_validate(spec).identity()


def write_test_archive(minio: LocalMinio, prefix: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Write a small real archive the way the SAVE Job would (blobs, then the manifest last)."""
    store = open_store(f"s3://{minio.bucket}/{prefix}", endpoint=minio.endpoint, region=minio.region,
                       access_key=minio.access_key, secret_key=minio.secret_key)
    result = write_archive(store, synthetic_graphset(graphs=4, nodes=30, groups=1), identity_of(spec), COMPAT,
                           kernel_images=synthetic_images())
    # what the SAVE Job's summary carries for the operator (ember.contract.SaveResult)
    return {"manifest_digest": result.manifest_digest, "manifest": result.manifest_uri, "bytes": result.bytes,
            "graphs": result.manifest.graphs.count, "identity": result.manifest.identity_hash,
            "published": True, "durations": {k: round(v, 3) for k, v in result.durations.items()}}


def wait_for(predicate: Callable[[], Any], what: str, op: OperatorProcess | None = None,
             timeout: float = 60.0, interval: float = 0.25) -> Any:
    try:
        return wait_until(predicate, timeout=timeout, interval=interval, what=what)
    except BaseException:
        if op is not None:
            print("---- operator log ----\n" + op.log_tail(120))
        raise


def phase(api: Api, name: str) -> str:
    return ((api.md(name).get("status") or {}).get("phase")) or ""


def now() -> float:
    return time.monotonic()


def refusal(call: Any) -> str:
    """The apiserver's refusal (403 or 422) of `call`, as its body; "" when it was accepted."""
    try:
        call()
    except ApiException as exc:
        assert exc.status in (403, 422), exc.body
        return str(exc.body)
    return ""
