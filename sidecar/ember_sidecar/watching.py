"""Watching this pod's own object for the operator's claim (kubernetes client watch).

A field-selector watch on metadata.name=<pod> in the pod's namespace: each event's annotations go
to the Restorer; DELETED, or a deletionTimestamp, means the pod is going away and the sidecar
stops (cancel, clean partial files, exit 0). Watches are resumed from the last resourceVersion,
relisted on 410 Gone, and retried with backoff when the API server is unreachable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class PodWatcher:
    """Feeds pod updates to `on_pod(pod_dict, observed_at)`; calls `on_gone()` when it is deleted."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        name: str,
        on_pod: Callable[[dict[str, Any], float], None],
        on_gone: Callable[[str], None],
        stop: threading.Event,
        timeout_s: int = 30,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.api_client = api_client
        self.namespace, self.name = namespace, name
        self.on_pod, self.on_gone, self.stop = on_pod, on_gone, stop
        self.timeout_s = timeout_s

    def _handle(self, pod: dict[str, Any], event_type: str) -> bool:
        """Deliver one pod version; True when the pod is going away."""
        meta = pod.get("metadata") or {}
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self.on_gone("deleted" if event_type == "DELETED" else "terminating")
            return True
        self.on_pod(pod, time.time())
        return False

    def run(self) -> None:
        """Watch until the pod is gone or `stop` is set. Never raises."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        selector = f"metadata.name={self.name}"
        rv: str | None = None
        delay = 0.5
        while not self.stop.is_set():
            try:
                if rv is None:
                    pods = self.core.list_namespaced_pod(self.namespace, field_selector=selector,
                                                         _request_timeout=10)
                    items = self.api_client.sanitize_for_serialization(pods).get("items", [])
                    if not items:
                        self.on_gone("not found")
                        return
                    if self._handle(items[0], "ADDED"):
                        return
                    rv = pods.metadata.resource_version if pods.metadata is not None else None
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, self.namespace, field_selector=selector,
                                   resource_version=rv, timeout_seconds=self.timeout_s,
                                   allow_watch_bookmarks=True, _request_timeout=self.timeout_s + 10,
                                   deserialize=False):  # plain dicts: no model objects per event
                    if self.stop.is_set():
                        w.stop()
                        return
                    obj = ev.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if ev.get("type") == "BOOKMARK":
                        continue
                    if self._handle(obj, ev["type"]):
                        return
                delay = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                log.warning("Pod watch failed (%s %s); retrying in %.1fs", exc.status, exc.reason, delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception as exc:  # network trouble: keep the sidecar up and retry
                log.warning("Pod watch interrupted (%s); retrying in %.1fs", exc, delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 10.0)
