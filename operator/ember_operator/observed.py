"""Small read-only views of observed objects (pods, archives, a deployment's recorded status)
that planning code consumes.

Planning takes these instead of raw API dicts so its tests can build observations in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ember import contract
from ember_operator.api import ModelDeploymentStatus


@dataclass(frozen=True)
class PodView:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    resource_version: str = ""
    phase: str = "Pending"
    ready: bool = False
    deleting: bool = False
    created: str = ""
    unschedulable: str = ""  # the scheduler's message while it cannot place the pod
    node: str = ""  # where the scheduler placed it ("" not yet)
    nominated: str = ""  # the node the scheduler preempts lower-priority pods on for it
    gpus: int = 0  # GPUs its containers ask for
    engine_restarts: int = 0  # restarts of the engine container (kubelet's restartCount)
    engine_exited: bool = False  # the engine container is terminated or was (lastState)

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodView:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        conds = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
        unschedulable = next((c.get("message") or "unschedulable" for c in conds
                              if c.get("type") == "PodScheduled" and c.get("status") == "False"
                              and c.get("reason") == "Unschedulable"), "")
        return cls(
            name=meta.get("name", ""),
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            resource_version=str(meta.get("resourceVersion", "")),
            phase=status.get("phase") or "Pending",
            ready=ready,
            deleting=bool(meta.get("deletionTimestamp")),
            created=str(meta.get("creationTimestamp") or ""),
            unschedulable=unschedulable if not ready else "",
            node=(pod.get("spec") or {}).get("nodeName") or "",
            nominated=status.get("nominatedNodeName") or "",
            gpus=_gpus(pod),
            **_engine_status(status),
        )

    @property
    def warm_for(self) -> str:
        """The deployment an identity-keyed warm pod was made for ("" for a template-keyed one)."""
        return self.labels.get(contract.LABEL_WARM_FOR, "")

    @property
    def pool_key(self) -> str:
        return self.labels.get(contract.LABEL_POOL_KEY, "")

    @property
    def engine(self) -> str:
        """What its sidecar says of the engine (ANN_ENGINE): loading, ready, failed: <reason>."""
        return self.annotations.get(contract.ANN_ENGINE, "")

    @property
    def engine_ready(self) -> bool:
        return self.engine == contract.ENGINE_READY

    @property
    def engine_crashed(self) -> bool:
        """The engine failed (its sidecar says so) or its container exited or restarted."""
        return (self.engine.startswith(contract.ENGINE_FAILED) or self.engine_restarts > 0
                or self.engine_exited)

    @property
    def revision(self) -> str:
        return self.labels.get(contract.LABEL_REVISION, "")

    @property
    def restore(self) -> str:
        return self.annotations.get(contract.ANN_RESTORE, "")

    @property
    def restore_time(self) -> str:
        """When the sidecar reported the restore (else when the pod was claimed); "" if neither."""
        ann = self.annotations
        return ann.get(contract.ANN_RESTORE_TIME) or ann.get(contract.ANN_CLAIMED_AT, "")

    @property
    def restored(self) -> bool:
        return self.restore == contract.RESTORED

    @property
    def fell_back(self) -> bool:
        return self.restore.startswith(contract.FALLBACK)

    @property
    def failed(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def native(self) -> bool:
        """Claimed without an archive (`ember.dev/archive: ""`): the engine captured natively."""
        return contract.ANN_ARCHIVE in self.annotations and not self.annotations[contract.ANN_ARCHIVE]

    @property
    def archive_uri(self) -> str:
        return self.annotations.get(contract.ANN_ARCHIVE, "")

    @property
    def manifest_digest(self) -> str:
        return self.annotations.get(contract.ANN_MANIFEST_DIGEST, "")

    @property
    def drain_at(self) -> str:
        """When the operator took the pod out of service ("" while in service)."""
        return self.annotations.get(contract.ANN_DRAIN, "")

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """(tensor, expert, data) the pod was claimed for; None if unclaimed. Tensor and expert are
        its identity's, data its world over tensor: a vLLM pod of dense data-parallel replicas has
        the data-1 identity (ember.engines.vllm.args.archived) and a world of all its GPUs."""
        try:
            par = json.loads(self.annotations[contract.ANN_IDENTITY_SPEC]).get("parallelism") or {}
            tensor, expert, data = (int(par.get(k, 1)) for k in ("tensor", "expert", "data"))
            world = int(self.annotations.get(contract.ANN_WORLD) or tensor * data)
        except (KeyError, ValueError, TypeError, AttributeError):
            return None
        return tensor, expert, max(data, world // max(tensor, 1))


def _engine_status(status: dict[str, Any]) -> dict[str, Any]:
    """restartCount and termination of the engine container (from the pod's containerStatuses)."""
    for c in status.get("containerStatuses") or []:
        if c.get("name") == contract.ENGINE_CONTAINER:
            state, last = c.get("state") or {}, c.get("lastState") or {}
            exited = bool(state.get("terminated") or last.get("terminated"))
            return {"engine_restarts": int(c.get("restartCount") or 0), "engine_exited": exited}
    return {}


def _gpus(pod: dict[str, Any]) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        limit = ((c.get("resources") or {}).get("limits") or {}).get(contract.GPU_RESOURCE, 0)
        total += int(limit) if str(limit).isdigit() else 0
    return total


@dataclass(frozen=True)
class ArchiveView:
    """What a ModelDeployment needs to know about its GraphArchive."""

    name: str
    phase: str = "Pending"
    uri: str = ""
    reason: str = ""
    message: str = ""
    next_retry_time: str = ""
    digest: str = ""  # sha256 of the manifest (claims pin it)

    @classmethod
    def of(cls, ga: dict[str, Any]) -> ArchiveView:
        status = ga.get("status") or {}
        conditions = status.get("conditions") or []
        saved: dict[str, Any] = next((c for c in conditions if c.get("type") == "Saved"), {})
        return cls(
            name=(ga.get("metadata") or {}).get("name", ""),
            phase=status.get("phase") or "Pending",
            uri=status.get("uri") or "",
            reason=saved.get("reason", ""),
            message=saved.get("message", "") or status.get("failureReason") or "",
            next_retry_time=status.get("nextRetryTime") or "",
            digest=status.get("digest") or "",
        )

    @property
    def available(self) -> bool:
        """Restorable: claims name the URI and pin the digest (never a claim without a pin)."""
        return self.phase == "Available" and bool(self.uri) and bool(self.digest)

    @property
    def failing(self) -> bool:
        """The archive cannot be had now (retrying): deployments serve with native capture.

        A store blip while a SAVE Job runs keeps the archive Saving: that is not failing (the Job
        may still write the manifest), so deployments wait instead of starting native pods."""
        store_trouble = self.reason in ("CredentialsSecretMissing", "StoreUnreachable")
        return self.phase == "Failed" or (store_trouble and self.phase != "Saving")


def status_of(raw: dict[str, Any]) -> ModelDeploymentStatus:
    """A deployment's status as this operator reads it. Fields it cannot read (written by another
    operator version: a phase or condition it does not know) start afresh; the others — the
    lifetime `warmClaims` above all — are kept, so a version change never resets them."""
    raw = dict(raw)
    while True:
        try:
            return ModelDeploymentStatus.model_validate(raw)
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if not bad & raw.keys():
                return ModelDeploymentStatus()
            raw = {k: v for k, v in raw.items() if k not in bad}
