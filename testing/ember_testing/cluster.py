"""The local control plane's side of the tests and benchmarks (`e2e/cluster.sh up`): its env
file, kwok fake GPU nodes, and `kubectl apply` with the kubectl it built."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
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
