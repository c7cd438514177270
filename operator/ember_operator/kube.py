"""The one place that talks to the Kubernetes API: a thin JSON-over-REST client.

Built on the official client's configuration and connection pool (kubeconfig, in-cluster service
account, exec plugins, token refresh) but exchanging plain dicts, so reconcilers work with the
same shapes as kopf bodies and the planning code. Thread-safe; used from kopf's executor threads.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ember import contract

log = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"


STOPPING = "Stopping"  # the reason of requests refused by a stopping operator


class KubeError(Exception):
    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        try:
            self.message = json.loads(body).get("message", reason)
        except (ValueError, AttributeError):
            self.message = body or reason
        super().__init__(f"{status} {reason}: {self.message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def stopping(self) -> bool:
        """Refused before sending: the operator is stopping (`Kube.stop`)."""
        return self.status == 0 and self.reason == STOPPING

    @property
    def rejected(self) -> bool:
        """The apiserver refused the request itself (invalid, forbidden by admission or quota):
        the same request cannot succeed on a retry. Not 404/409 (races) nor 429 (throttling)."""
        return 400 <= self.status < 500 and self.status not in (404, 409, 429)


def load_configuration(pool_size: int = 32) -> client.Configuration:
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    return cfg


class Kube:
    def __init__(self, configuration: client.Configuration | None = None, pool_size: int = 32) -> None:
        self.api = client.ApiClient(configuration or load_configuration(pool_size))
        self.stopped = threading.Event()

    def stop(self) -> None:
        """No new requests from now on (each raises KubeError 0 "Stopping"): a pass in progress
        ends with its in-flight requests, so a stop signal waits for those, not for a whole batch."""
        self.stopped.set()

    def request(
        self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None,
        content_type: str = "application/json", timeout: float = 30.0,
    ) -> dict[str, Any]:
        if self.stopped.is_set():
            raise KubeError(0, STOPPING, "the operator is stopping: no new API requests")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if query:
            path = f"{path}?{urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})}"
        _, url, headers, _, _ = self.api.param_serialize(
            method=method, resource_path=path, header_params=headers, auth_settings=["BearerToken"],
        )
        try:
            # The REST layer JSON-encodes `body` for every application/*json content type.
            resp = self.api.call_api(
                method, url, header_params=headers, body=body, _request_timeout=timeout,
            )
            data = resp.read()
        except ApiException as exc:
            raise KubeError(exc.status or 0, exc.reason or "", exc.body or "") from None
        if resp.status >= 400:
            raise KubeError(resp.status, resp.reason or "", data.decode(errors="replace") if data else "")
        return json.loads(data) if data else {}

    # ---- conveniences
    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.request("GET", path, query={"labelSelector": label_selector}).get("items") or []

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST; None when it already exists (deterministic names make creation idempotent)."""
        try:
            return self.request("POST", path, body=body)
        except KubeError as exc:
            if exc.conflict and "already exists" in exc.message:
                return None
            raise

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body=body, content_type=MERGE)

    def delete(self, path: str, *, propagation: str = "Background") -> bool:
        try:
            self.request("DELETE", path, body={"propagationPolicy": propagation})
            return True
        except KubeError as exc:
            if exc.not_found:
                return False
            raise


# ---- paths
def md_path(ns: str, name: str = "") -> str:
    base = f"/apis/{contract.API_VERSION}/namespaces/{ns}/{contract.MODEL_DEPLOYMENTS}"
    return f"{base}/{name}" if name else base


def ga_path(ns: str, name: str = "") -> str:
    base = f"/apis/{contract.API_VERSION}/namespaces/{ns}/{contract.GRAPH_ARCHIVES}"
    return f"{base}/{name}" if name else base


def pods_path(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/pods" + (f"/{name}" if name else "")


def jobs_path(ns: str, name: str = "") -> str:
    return f"/apis/batch/v1/namespaces/{ns}/jobs" + (f"/{name}" if name else "")


def hpa_path(ns: str, name: str = "") -> str:
    return f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers" + (f"/{name}" if name else "")


def secret_path(ns: str, name: str) -> str:
    return f"/api/v1/namespaces/{ns}/secrets/{name}"


def events_path(ns: str) -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{ns}/events"


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` as a JSON merge patch over `old`: fields that disappeared become null (removed)."""
    patch: dict[str, Any] = dict(new)
    for key, value in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(value, dict) and isinstance(new[key], dict):
            patch[key] = merge_patch(value, new[key])
    return patch
