"""The GraphArchive reconciler: an archive's SAVE Job, its store probe, its status and gauges.

Part of `reconcilers.Reconciler` (whose helpers it uses: the API client, events, status patches,
the deployments of an identity); planning is `archive_planning`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ember import contract
from ember.identity import identity_short
from ember_operator import metrics, naming
from ember_operator.api import GAPhase, GraphArchiveSpec, GraphArchiveStatus
from ember_operator.archive_planning import ArchiveObserved, ArchivePlan, Backoff, job_refused, plan_archive
from ember_operator.conditions import Event, parse_time
from ember_operator.jobs import pod_stuck, read_termination, save_job
from ember_operator.kube import Kube, KubeError, ga_path, jobs_path, pods_path
from ember_operator.planning import Context
from ember_operator.pods import StoreAccess
from ember_operator.settings import Settings
from ember_operator.store_probe import probe_archive

log = logging.getLogger("ember_operator")


class ArchiveReconciling:
    """`reconcile_archive` and its steps; the Reconciler provides the attributes below."""

    kube: Kube
    settings: Settings
    clock: Callable[[], datetime]
    ctx: Context
    backoff: Backoff
    _parallel: Callable[..., list[Any]]
    post_events: Callable[[dict[str, Any], list[Event]], None]
    _patch_status: Callable[[str, dict[str, Any] | None, dict[str, Any]], bool]
    _refusal: Callable[..., list[str]]
    deployments_using: Callable[[str, str], list[str]]

    def reconcile_archive(self, namespace: str, name: str) -> float | None:
        """Returns seconds until the archive wants another look (retry, verification), or None."""
        started = time.perf_counter()
        try:
            return self._reconcile_archive(namespace, name)
        except Exception:
            metrics.RECONCILE_ERRORS.labels("GraphArchive").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.labels("GraphArchive").observe(time.perf_counter() - started)

    def _reconcile_archive(self, ns: str, name: str) -> float | None:
        ga = self.kube.get(ga_path(ns, name))
        if ga is None or (ga.get("metadata") or {}).get("deletionTimestamp"):
            metrics.STATE.forget_archive(ns, name)
            return None
        meta = ga["metadata"]
        try:
            spec = GraphArchiveSpec.model_validate(ga.get("spec") or {})
            status = GraphArchiveStatus.model_validate(ga.get("status") or {})
        except ValidationError as exc:
            log.error("GraphArchive %s/%s is invalid (edited by hand, or written by another operator "
                      "version?); delete it and its ModelDeployments recreate it: %s", ns, name, exc)
            return None
        short = identity_short(spec.identity_hash)
        # Users: deployments of the identity and serving/warm pods restoring it. SAVE pods carry
        # the identity label too but are no users (counting them kept archives alive for ever).
        refs = len(self.deployments_using(ns, short)) + len(
            self.kube.list(pods_path(ns), f"{contract.LABEL_IDENTITY}={short},{contract.LABEL_POOL}")
        )
        timeout = self.settings.store_probe_timeout_seconds
        probe = probe_archive(self.kube, ns, spec, self.ctx.tenancy, timeout)
        listed = self.kube.list(jobs_path(ns), f"{contract.LABEL_ARCHIVE}={name}")
        jobs = {j["metadata"]["name"]: j for j in listed}
        current = naming.save_job_name(spec.identity_hash, status.attempt)
        result, stuck = None, None
        if current in jobs:
            pods = self.kube.list(pods_path(ns), f"job-name={current}")
            for pod in pods:
                result = read_termination(pod) or result
            stuck = self._save_stuck(ns, current, pods)
        obs = ArchiveObserved(
            name=name, namespace=ns, uid=meta["uid"], generation=int(meta.get("generation") or 0),
            spec=spec, status=status, probe=probe, now=self.clock(), jobs=jobs, result=result,
            references=refs, stuck=stuck,
        )
        plan = plan_archive(obs, self.backoff)
        if plan.delete_jobs:
            log.info("GraphArchive %s/%s: no user; deleting SAVE Job(s) %s", ns, name, sorted(jobs))
            self._parallel(lambda job: self.kube.delete(jobs_path(ns, job)), sorted(jobs))
        if plan.delete:
            self.post_events(ga, plan.events)
            self.kube.delete(ga_path(ns, name))
            metrics.STATE.forget_archive(ns, name)
            return None
        if plan.create_job_attempt is not None:
            self._create_save_job(obs, plan, meta["uid"])
        started_at = parse_time(status.save_started_time)
        if plan.saved_now:
            metrics.SAVES_TOTAL.labels("succeeded").inc()
            if started_at is not None and status.save_job:
                metrics.SAVE_SECONDS.observe((obs.now - started_at).total_seconds())
        if plan.save_failed_now:
            metrics.SAVES_TOTAL.labels("failed").inc()
        self._patch_status(ga_path(ns, name), ga.get("status"), plan.status.wire())
        self.post_events(ga, plan.events)
        self._archive_gauges(ns, name, spec, plan.status)
        return plan.requeue_after

    def _archive_gauges(self, ns: str, name: str, spec: GraphArchiveSpec, st: GraphArchiveStatus) -> None:
        phase = st.phase.value if st.phase else ""
        started = parse_time(st.save_started_time) if st.phase is GAPhase.saving else None
        begun = started.timestamp() if started is not None else None
        timeout = spec.save.timeout_seconds or self.settings.save_timeout_seconds
        metrics.STATE.set_archive(ns, name, metrics.Archive(
            phase, st.bytes if st.phase is GAPhase.available else None, begun,
            begun + timeout if begun is not None else None))

    def _create_save_job(self, obs: ArchiveObserved, plan: ArchivePlan, uid: str) -> None:
        """The SAVE Job of the plan's attempt; refused by the apiserver → that attempt failed."""
        ns, name, spec = obs.namespace, obs.name, obs.spec
        attempt = plan.create_job_attempt or 0
        job_name = naming.save_job_name(spec.identity_hash, attempt)
        body = save_job(
            name=job_name, namespace=ns, archive_name=name, archive_uid=uid, spec=spec,
            store=StoreAccess.of(spec.store), sidecar_image=self.settings.sidecar_image,
            timeout_seconds=self.settings.save_timeout_seconds, attempt=attempt,
        )
        if refused := self._refusal(f"SAVE Job {job_name}", self.kube.create, jobs_path(ns), body):
            job_refused(obs, plan, self.backoff, refused[0])
        else:
            log.info("GraphArchive %s/%s: SAVE Job %s created", ns, name, job_name)

    def _save_stuck(self, ns: str, job: str, pods: list[dict[str, Any]]) -> tuple[str, str] | None:
        """Why the SAVE Job runs nothing: its pod cannot be scheduled/pulled, or the Job controller
        cannot create the pod (FailedCreate events on the Job: quota, admission, invalid spec)."""
        for pod in pods:
            if why := pod_stuck(pod):
                return "SaveUnschedulable", why
        if pods:
            return None
        query = {"fieldSelector": f"involvedObject.kind=Job,involvedObject.name={job},reason=FailedCreate"}
        try:
            listed = self.kube.request("GET", f"/api/v1/namespaces/{ns}/events", query=query)
        except KubeError as exc:  # best effort (RBAC: list core events)
            log.warning("Reading events of SAVE Job %s/%s failed: %s", ns, job, exc)
            return None
        events = listed.get("items") or []
        if events:
            last = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            return "SaveFailedCreate", f"FailedCreate: {last.get('message', '')}"
        return None
