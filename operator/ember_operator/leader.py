"""Leader election over a coordination.k8s.io Lease: exactly one operator replica reconciles.

Every replica runs `LeaderElector.step()` every `retry_s`: it reads the Lease, takes it when it is
free or expired, renews it when held, and otherwise waits. Writes are conditional on the
Lease's resourceVersion (a PUT), so two candidates can never both win one round. Like client-go,
expiry is judged on this replica's own clock from when it last saw the Lease *change* (not from
the holder's renewTime), so clock skew between nodes does not matter.

A leader that cannot renew for `renew_deadline_s` stops leading before its Lease can expire for
the others (renew deadline < lease duration). A replica that stops cleanly releases the Lease
(holder cleared), so a standby takes over at its next step instead of after the full duration;
a SIGKILLed leader is replaced after at most lease duration + one retry period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.contract import format_claimed_at
from ember_operator.kube import Kube, KubeError

log = logging.getLogger("ember_operator")


def lease_path(namespace: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


@dataclass
class _Seen:
    """The Lease as last observed, and when (this replica's monotonic clock)."""

    version: str = ""
    holder: str = ""
    duration_s: float = 0.0
    at: float = 0.0


class LeaderElector:
    """One candidate. Thread-safe reads of `leading`; `step()` is called from one loop."""

    def __init__(
        self, kube: Kube, namespace: str, name: str, identity: str, *, duration_s: float = 10.0,
        renew_deadline_s: float | None = None, clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s = duration_s
        self.renew_deadline_s = renew_deadline_s if renew_deadline_s is not None else duration_s * 2 / 3
        self.clock, self.wall = clock, wall
        self._seen = _Seen()
        self._renewed_at: float | None = None  # monotonic time of our last successful write
        self._lock = threading.Lock()
        self._released = False  # stopped: never take the Lease again

    @property
    def path(self) -> str:
        return lease_path(self.namespace, self.name)

    @property
    def leading(self) -> bool:
        """True while our last renewal is younger than the renew deadline."""
        with self._lock:
            return self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline_s

    def step(self) -> bool:
        """One election round; returns whether this replica leads afterwards. API errors count as
        a failed renewal (the deadline decides when leadership is lost)."""
        if self._released:
            return False
        try:
            self._try()
        except KubeError as exc:
            log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
        return self.leading

    def _try(self) -> None:
        lease = self.kube.get(self.path)
        now = self.clock()
        if lease is None:
            self._write("POST", lease_path(self.namespace), self._body(None, transitions=0))
            return
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        version = str(meta.get("resourceVersion", ""))
        if version != self._seen.version:
            self._seen = _Seen(version, holder, float(spec.get("leaseDurationSeconds") or 0), now)
        if holder and holder != self.identity and now - self._seen.at < self._seen.duration_s:
            self._lost()  # held by a live peer
            return
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        acquired = spec.get("acquireTime") if holder == self.identity else None
        self._write("PUT", self.path, self._body(lease, transitions, acquired))

    def _body(
        self, lease: dict[str, Any] | None, transitions: int, acquired: str | None = None,
    ) -> dict[str, Any]:
        stamp = format_claimed_at(self.wall())  # a Lease MicroTime: RFC 3339, UTC, 6 fraction digits
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is not None:
            meta = {**lease["metadata"]}  # resourceVersion: the PUT is conditional
        return {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.duration_s)),
                     "acquireTime": acquired or stamp, "renewTime": stamp, "leaseTransitions": transitions},
        }

    def _write(self, method: str, path: str, body: dict[str, Any]) -> None:
        was = self.leading
        try:
            written = self.kube.request(method, path, body=body)
        except KubeError as exc:
            if exc.conflict:  # another candidate wrote first: it leads this round
                self._lost()
                return
            raise
        with self._lock:
            self._renewed_at = self.clock()
        self._seen = _Seen(str((written.get("metadata") or {}).get("resourceVersion", "")), self.identity,
                           self.duration_s, self.clock())
        if not was:
            log.info("Leading: holding Lease %s/%s as %s", self.namespace, self.name, self.identity)

    def _lost(self) -> None:
        with self._lock:
            if self._renewed_at is None:
                return
            self._renewed_at = None
        log.warning("No longer leading: Lease %s/%s is held by %s", self.namespace, self.name,
                    self._seen.holder or "another replica")

    def release(self) -> None:
        """Give the Lease up (a clean stop): the next candidate takes it at its next step. This
        candidate never takes it again (an election round still in flight must not re-take it)."""
        self._released = True
        if not self.leading:
            return
        with self._lock:
            self._renewed_at = None
        try:
            lease = self.kube.get(self.path)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"].update({"holderIdentity": None, "leaseDurationSeconds": 1})
                self.kube.request("PUT", self.path, body=lease)
                log.info("Released Lease %s/%s", self.namespace, self.name)
        except KubeError as exc:  # it expires on its own
            log.warning("Releasing Lease %s/%s failed: %s", self.namespace, self.name, exc)
