"""Where restore results go: pod annotation + events (Kubernetes) or the log (standalone).

`Reporter` is the small interface the restore logic calls; `KubeReporter` patches
`ember.dev/restore` on the pod and records events on the pod and on its ModelDeployment (found
through the pod's `ember.dev/deployment` label); `LogReporter` only logs. Neither ever raises:
reporting trouble must not turn into a crash loop.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Protocol

from ember import contract
from ember.contract import ANN_RESTORE, ANN_RESTORE_TIME, LABEL_DEPLOYMENT

log = logging.getLogger(__name__)

COMPONENT = "ember-sidecar"
MAX_ANNOTATION = 1024


class Reporter(Protocol):
    def result(self, value: str) -> None:
        """Record the restore result (`restored` or `fallback: <reason>`)."""

    def event(self, type_: str, reason: str, message: str, *, deployment: bool = False) -> None:
        """Record an event on the pod (and on its ModelDeployment when `deployment`)."""

    def engine(self, value: str) -> None:
        """Record the engine's state (`ember.dev/engine`: loading, ready, failed: <reason>)."""


class LogReporter:
    """Standalone mode: results and events go to the log only."""

    def __init__(self) -> None:
        self.results: list[str] = []
        self.engines: list[str] = []

    def result(self, value: str) -> None:
        self.results.append(value)
        log.info("Restore result: %s", value)

    def engine(self, value: str) -> None:
        self.engines.append(value)

    def event(self, type_: str, reason: str, message: str, *, deployment: bool = False) -> None:
        (log.warning if type_ == "Warning" else log.info)("Event %s %s: %s", type_, reason, message)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeReporter:
    """Pod annotation and core/v1 Events through the kubernetes client."""

    def __init__(self, api_client: Any, namespace: str, pod_name: str) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace, self.pod_name = namespace, pod_name
        self.pod_uid: str = ""
        self.deployment: str = ""
        self._md_uid: dict[str, str] = {}

    def update_pod(self, pod: dict[str, Any]) -> None:
        """Remember the pod's uid and its ModelDeployment label (called on every watch event)."""
        meta = pod.get("metadata") or {}
        self.pod_uid = meta.get("uid") or self.pod_uid
        self.deployment = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT, "") or self.deployment

    def result(self, value: str) -> None:
        body = {"metadata": {"annotations": {ANN_RESTORE: value[:MAX_ANNOTATION],
                                             ANN_RESTORE_TIME: _now()}}}
        try:
            self.core.patch_namespaced_pod(self.pod_name, self.namespace, body)
        except Exception as exc:  # never let reporting take the sidecar down
            log.warning("Could not annotate pod %s/%s with %s: %s",
                        self.namespace, self.pod_name, ANN_RESTORE, exc)

    def engine(self, value: str) -> None:
        body = {"metadata": {"annotations": {contract.ANN_ENGINE: value[:MAX_ANNOTATION]}}}
        try:
            self.core.patch_namespaced_pod(self.pod_name, self.namespace, body)
        except Exception as exc:  # never let reporting take the sidecar down
            log.warning("Could not annotate pod %s/%s with %s: %s",
                        self.namespace, self.pod_name, contract.ANN_ENGINE, exc)

    def _md_ref(self) -> dict[str, str] | None:
        name = self.deployment
        if not name:
            return None
        if name not in self._md_uid:
            try:
                obj: Any = self.custom.get_namespaced_custom_object(
                    contract.GROUP, contract.VERSION, self.namespace, contract.MODEL_DEPLOYMENTS, name
                )
                self._md_uid[name] = obj.get("metadata", {}).get("uid", "")
            except Exception as exc:
                log.info("ModelDeployment %s/%s not readable (%s); event without uid",
                         self.namespace, name, exc)
                self._md_uid[name] = ""
        ref = {"apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT, "name": name,
               "namespace": self.namespace}
        if uid := self._md_uid[name]:
            ref["uid"] = uid
        return ref

    def event(self, type_: str, reason: str, message: str, *, deployment: bool = False) -> None:
        pod_ref = {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "namespace": self.namespace}
        if self.pod_uid:
            pod_ref["uid"] = self.pod_uid
        targets = [pod_ref]
        if deployment and (md := self._md_ref()) is not None:
            targets.append(md)
        for ref in targets:
            now = _now()
            text = (f"pod {self.pod_name}: " if ref["kind"] != "Pod" else "") + message[:900]
            name = contract.event_name(ref["name"], ref["kind"], ref.get("uid", ""), type_, reason, text)
            body = {
                "metadata": {"name": name, "namespace": self.namespace},
                "involvedObject": ref,
                "type": type_,
                "reason": reason,
                "message": text,
                "source": {"component": COMPONENT},
                "reportingComponent": f"{contract.GROUP}/{COMPONENT}",
                "reportingInstance": self.pod_name,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            try:
                self._post(name, body, now)
            except Exception as exc:
                log.warning("Could not record %s event %s on %s %s: %s",
                            type_, reason, ref["kind"], ref["name"], exc)

    def _post(self, name: str, body: dict[str, Any], now: str) -> None:
        """Create the event; one posted before under its deterministic name counts once more."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespaced_event(self.namespace, body)  # type: ignore[arg-type]  # a dict is accepted
        except ApiException as exc:
            if exc.status != 409:
                raise
            seen = self.core.read_namespaced_event(name, self.namespace)
            self.core.patch_namespaced_event(name, self.namespace,
                                             {"count": (seen.count or 1) + 1, "lastTimestamp": now})
