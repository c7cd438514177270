"""Session fixtures for the real local control plane (`k8s`) and MinIO (`minio`).

Both come from `e2e/cluster.sh up`, which is idempotent: the first test that needs them starts
what is not running (seconds once the binaries are built) and later ones reuse it. Under CI
(env CI=true) `up` also builds the binaries and any failure fails the tests; locally, missing
binaries fail with a message that says to run `e2e/cluster.sh up` once. Nothing here skips.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# ENV_FILE: e2e/.work/env, or $EMBER_E2E_WORK/env (the scripts honour it too).
from ember_testing.cluster import ENV_FILE, read_env_file

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "e2e"
CLUSTER_SH = E2E / "cluster.sh"
BUILD_SH = E2E / "build.sh"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


# Under CI `up` may include the cold Go builds.
UP_TIMEOUT_S = 3600 if in_ci() else 600


def wait_until(
    predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5, what: str = "condition"
) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last value: {last!r})")


def cluster_up() -> dict[str, str]:
    """Run `e2e/cluster.sh up` (no-op when running) and return the env file's variables."""
    if not in_ci():
        check = subprocess.run([str(BUILD_SH), "--check"], capture_output=True, text=True)
        if check.returncode != 0:
            pytest.fail(
                f"local cluster binaries are not built ({check.stderr.strip()}): "
                "run `e2e/cluster.sh up` once (it builds them, ~15-25 min cold), then rerun the tests",
                pytrace=False,
            )
    try:
        proc = subprocess.run([str(CLUSTER_SH), "up"], capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`e2e/cluster.sh up` did not finish in {UP_TIMEOUT_S}s", pytrace=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        pytest.fail(f"`e2e/cluster.sh up` failed (exit {proc.returncode}):\n{tail}", pytrace=False)
    return read_env_file(ENV_FILE)


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message includes kubectl's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr or ''}".rstrip()


@dataclass
class LocalCluster:
    """The running local control plane, as tests see it."""

    kubeconfig: Path
    kubectl_path: Path
    api_client: Any  # kubernetes.client.ApiClient
    _namespaces: list[str] = field(default_factory=list)

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a throwaway namespace (deleted at the end of the session) and return its name.

        Waits for its `default` service account: pods are rejected until it exists.
        """
        from kubernetes import client

        core = client.CoreV1Api(self.api_client)
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        self._namespaces.append(name)

        def has_default_sa() -> bool:
            sas = core.list_namespaced_service_account(name, field_selector="metadata.name=default")
            return bool(sas.items)

        wait_until(has_default_sa, timeout=30, what=f"default service account in {name}")
        return name

    def delete_namespace(self, name: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            client.CoreV1Api(self.api_client).delete_namespace(name)
        with contextlib.suppress(ValueError):
            self._namespaces.remove(name)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the cluster's own kubectl (same build as the control plane)."""
        cmd = [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc


@dataclass(frozen=True)
class LocalMinio:
    """The running MinIO server: endpoint, credentials and a test bucket."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str

    @property
    def env(self) -> dict[str, str]:
        """Environment for code that uses the standard boto3 chain plus EMBER_S3_ENDPOINT."""
        return {
            "EMBER_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing, as MinIO wants)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
        )


@pytest.fixture(scope="session")
def local_cluster_env() -> dict[str, str]:
    """Starts (or reuses) the local control plane and MinIO once per session; their env vars."""
    return cluster_up()


@pytest.fixture(scope="session")
def k8s(local_cluster_env: dict[str, str]) -> Iterator[LocalCluster]:
    """The real local control plane: kubeconfig, kubernetes ApiClient, namespace helper."""
    from kubernetes import config

    kubeconfig = Path(local_cluster_env["KUBECONFIG"])
    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    cluster = LocalCluster(
        kubeconfig=kubeconfig,
        kubectl_path=Path(local_cluster_env["EMBER_E2E_KUBECTL"]),
        api_client=api_client,
    )
    yield cluster
    for name in list(cluster._namespaces):
        cluster.delete_namespace(name)
    api_client.close()


@pytest.fixture
def k8s_namespace(k8s: LocalCluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = k8s.create_namespace()
    yield name
    k8s.delete_namespace(name)


@pytest.fixture(scope="session")
def minio(local_cluster_env: dict[str, str]) -> LocalMinio:
    """The real local MinIO server with the test bucket created."""
    return LocalMinio(
        endpoint=local_cluster_env["EMBER_S3_ENDPOINT"],
        access_key=local_cluster_env["AWS_ACCESS_KEY_ID"],
        secret_key=local_cluster_env["AWS_SECRET_ACCESS_KEY"],
        bucket=local_cluster_env["EMBER_S3_BUCKET"],
        region=local_cluster_env["EMBER_S3_REGION"],
    )
