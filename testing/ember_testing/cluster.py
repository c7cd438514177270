"""The local control plane's side of the tests and benchmarks (`e2e/cluster.sh up`): its env
file, kwok fake GPU nodes, `kubectl apply` with the kubectl it built, and the stand-in for the
sidecar's engine report on warm pods (`EngineStandIn`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
from pathlib import Path
from typing import Any

from ember import contract

REPO = Path(__file__).resolve().parents[2]
# EMBER_E2E_WORK moves e2e/.work (the scripts honour it too), e.g. for a second cluster.
ENV_FILE = Path(os.environ.get("EMBER_E2E_WORK", REPO / "e2e" / ".work")) / "env"


def read_env_file(path: Path) -> dict[str, str]:
    """Parse the `export KEY=VALUE` lines that cluster.sh writes."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ")
        key, sep, value = line.partition("=")
        if sep:
            env[key] = shlex.split(value)[0] if value else ""
    return env


def e2e_env() -> dict[str, str]:
    """The local cluster's variables (ENV_FILE); {} before the first `e2e/cluster.sh up`."""
    return read_env_file(ENV_FILE) if ENV_FILE.is_file() else {}


def fake_gpu_nodes(prefix: str, product: str, count: int = 2, gpus: int = 512) -> list[dict[str, Any]]:
    """kwok-managed Node objects with `gpus` GPUs of `product` each (labels/taint like a GPU node)."""
    nodes = []
    for i in range(count):
        name = f"{prefix}-{i}"
        capacity = {"cpu": "4096", "memory": "64Ti", "pods": str(gpus * 4), contract.GPU_RESOURCE: str(gpus)}
        nodes.append({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                           "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true",
                           contract.GPU_PRODUCT_NODE_LABEL: product},
            },
            "spec": {"taints": [{"key": contract.GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]},
            "status": {"capacity": capacity, "allocatable": capacity},
        })
    return nodes


def kubectl_bin() -> str:
    """The kubectl that `e2e/cluster.sh up` built (its env file's EMBER_E2E_KUBECTL), else `kubectl`."""
    return e2e_env().get("EMBER_E2E_KUBECTL") or "kubectl"


def kubectl_apply(kubeconfig: str, objects: list[dict[str, Any]]) -> None:
    subprocess.run([kubectl_bin(), "--kubeconfig", kubeconfig, "apply", "--server-side", "--force-conflicts",
                    "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
                   text=True, check=True, capture_output=True)


class EngineStandIn:
    """kwok runs no container: as kwok plays the kubelet (a scheduled pod turns Ready), this plays
    the sidecar's report of a loaded, idle engine (`ember.dev/engine: ready`) on every
    identity-keyed warm pod of `namespace` once it is scheduled, so the operator may claim it.
    The k8s tests that claim warm pods and the operator benches turn it on; `state` plays another
    report (`failed: <reason>`: an engine that fails at load). A context manager;
    its own API client, so its watch never shares a connection pool with the caller's reads."""

    def __init__(self, kubeconfig: str | Path, namespace: str, state: str = contract.ENGINE_READY) -> None:
        from kubernetes import client, config

        self.namespace, self.state, self.stop = namespace, state, threading.Event()
        self.core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        self.thread = threading.Thread(target=self._run, name="engine-stand-in", daemon=True)
        self.marked: set[str] = set()  # the pods it marked ready

    def __enter__(self) -> EngineStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        from kubernetes import watch

        selector = f"{contract.LABEL_POOL}={contract.POOL_WARM},{contract.LABEL_WARM_FOR}"
        while not self.stop.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=30,
                                   label_selector=selector):
                    if self.stop.is_set():
                        w.stop()
                        return
                    self._mark(ev["object"])
            except Exception:  # the namespace going away, an apiserver blip: look again
                self.stop.wait(0.2)

    def _mark(self, pod: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        meta = pod.metadata
        if meta.deletion_timestamp or not pod.spec.node_name:
            return
        if contract.ANN_ENGINE in (meta.annotations or {}):
            return
        try:
            self.core.patch_namespaced_pod(meta.name, self.namespace, {"metadata": {
                "annotations": {contract.ANN_ENGINE: self.state}}})
            self.marked.add(meta.name)
        except ApiException as exc:
            if exc.status != 404:
                raise
