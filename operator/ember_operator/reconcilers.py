"""Reconcilers: read what is there, call the pure planners, apply the plan, record status and events.

One idempotent, level-based function per kind (`reconcile_deployment`, `reconcile_pools` here,
`reconcile_archive` in `archive_reconciler`), reached from kopf's create/update/resume handlers, a
timer and watch events of the objects they own (see `handlers`). All API traffic goes through
`kube.Kube`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from ember import contract
from ember.contract import Claim
from ember_operator import conditions, metrics, naming, placement, switching
from ember_operator.api import (
    MDPhase,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    ShapeSpec,
)
from ember_operator.archive_planning import (
    Backoff,
)
from ember_operator.archive_reconciler import ArchiveReconciling
from ember_operator.conditions import Event
from ember_operator.kube import (
    Kube,
    KubeError,
    events_path,
    ga_path,
    hpa_path,
    md_path,
    merge_patch,
    pods_path,
)
from ember_operator.limits import Left, Limits, Notices, apply_limits, namespace_left
from ember_operator.observed import ArchiveView, PodView, status_of
from ember_operator.phases import settle
from ember_operator.planning import (
    INVALID_SPEC,
    Context,
    Observed,
    Plan,
    claim_for,
    free_names,
    plan_deployment,
    record_refusals,
    refused_status,
    template_of,
    validation_text,
)
from ember_operator.pods import PodTemplate, serving_pod
from ember_operator.pools import WarmWant, gpu_starved, plan_pools, pool_wants, warm_pool_size, warm_to_yield
from ember_operator.services import apply_service
from ember_operator.settings import Settings
from ember_operator.tenancy import Refused
from ember_operator.warm_backoff import Failure, WarmBackoff

log = logging.getLogger("ember_operator")


def _now() -> datetime:
    return datetime.now(UTC)


class Reconciler(ArchiveReconciling):
    def __init__(self, kube: Kube, settings: Settings, clock: Callable[[], datetime] = _now) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self.ctx = Context(
            sidecar_image=settings.sidecar_image, default_store=settings.default_store,
            default_s3_endpoint=settings.default_s3_endpoint,
            pod_service_account=settings.pod_service_account, signing_secret=settings.signing_secret,
            local_store_root=settings.local_store_root,
            presave_priority_class=settings.presave_priority_class,
            warm_priority_class=settings.warm_priority_class,
            serving_priority_class=settings.serving_priority_class,
            store_endpoints=settings.store_endpoint_list(),
            credential_namespaces=settings.credential_namespace_list(), pod_batch=settings.pod_batch,
        )
        self.limits = Limits(max_replicas=settings.max_replicas, max_warm_gpus=settings.max_warm_gpus,
                             max_gpus_per_pod=settings.max_gpus_per_pod,
                             max_namespace_replicas=settings.max_namespace_replicas,
                             max_namespace_warm_gpus=settings.max_namespace_warm_gpus)
        self.notices = Notices()  # cap Warnings already posted
        self.backoff = Backoff(
            base_s=settings.save_backoff_seconds, max_s=settings.save_backoff_max_seconds,
            grace_s=settings.manifest_grace_seconds, retention_s=settings.archive_retention_seconds,
        )
        self.pool = ThreadPoolExecutor(max(1, settings.claim_concurrency), thread_name_prefix="ember-api")
        self.instance = socket.gethostname()
        self._pool_faults: dict[tuple[str, str], str] = {}  # (ns, pool key) → last refusal reported
        self.warm_backoff = WarmBackoff(settings.warm_backoff_seconds, settings.warm_backoff_max_seconds)

    # ------------------------------------------------------------------ helpers
    def _parallel(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        return list(self.pool.map(fn, items))

    def post_events(self, obj: dict[str, Any], events: list[Event]) -> None:
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "default")
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

        def post(ev: Event) -> None:
            name = contract.event_name(meta.get("name", "ember"), meta.get("uid", ""), ev.type, ev.reason,
                                       ev.message[:1024])
            body = {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": ns},
                "eventTime": stamp,
                "reportingController": f"{contract.GROUP}/operator",
                "reportingInstance": self.instance[:128],
                "action": ev.reason[:128] or "Reconcile",
                "reason": ev.reason[:128] or "Reconcile",
                "note": ev.message[:1024],
                "type": ev.type,
                "regarding": {
                    "apiVersion": obj.get("apiVersion", contract.API_VERSION), "kind": obj.get("kind", ""),
                    "name": meta.get("name", ""), "namespace": ns, "uid": meta.get("uid", ""),
                },
            }
            try:
                if self.kube.create(events_path(ns), body) is None:  # posted before: one more of a series
                    seen = self.kube.get(f"{events_path(ns)}/{name}") or {}
                    count = int((seen.get("series") or {}).get("count") or 1) + 1
                    self.kube.patch(f"{events_path(ns)}/{name}",
                                    {"series": {"count": count, "lastObservedTime": stamp}})
            except KubeError as exc:  # events are best effort
                log.warning("Posting event %s on %s %s/%s failed (best effort; the operator needs "
                            "create on events.k8s.io events): %s", ev.reason, obj.get("kind"), ns,
                            meta.get("name"), exc)
            log.info("%s %s/%s: %s %s", obj.get("kind"), ns, meta.get("name"), ev.reason, ev.message)

        self._parallel(post, events)

    def _patch_status(self, path: str, old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
        if (old or {}) == new:
            return False
        try:
            self.kube.patch(path + "/status", {"status": merge_patch(old or {}, new)})
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return True

    # ------------------------------------------------------------------ ModelDeployment
    def reconcile_deployment(self, namespace: str, name: str) -> float | None:
        """Returns seconds until the next look when the apiserver refused part of the plan."""
        started = time.perf_counter()
        try:
            return self._reconcile_deployment(namespace, name, started)
        except Exception:
            metrics.RECONCILE_ERRORS.labels("ModelDeployment").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.labels("ModelDeployment").observe(time.perf_counter() - started)

    def _reconcile_deployment(self, ns: str, name: str, started: float) -> float | None:
        md = self.kube.get(md_path(ns, name))
        if md is None or (md.get("metadata") or {}).get("deletionTimestamp"):
            return None
        meta = md["metadata"]
        status = status_of(md.get("status") or {})  # what another operator version wrote, as far as readable
        try:
            spec, capped = apply_limits(ModelDeploymentSpec.model_validate(md.get("spec") or {}), self.limits,
                                        self._left(ns, meta))
            template = template_of(ns, spec, self.ctx)
        except (ValidationError, ValueError) as exc:
            # Refused (a spec admission could not judge, or a store this namespace may not use):
            # said in the status (phase Invalid), and nothing else is done until it is fixed.
            reason = exc.reason if isinstance(exc, Refused) else INVALID_SPEC
            message = str(exc) if isinstance(exc, Refused) else validation_text(exc)
            log.error("ModelDeployment %s/%s is refused (%s); it is not reconciled until it is fixed: %s",
                      ns, name, reason, message)
            generation = int(meta.get("generation") or 0)
            new, events = refused_status(status, generation, self.clock(), reason, message)
            self._patch_status(md_path(ns, name), md.get("status"), new.wire())
            self.post_events(md, events)
            return None
        obs = self._observe_deployment(ns, name, meta, spec, status, template)
        plan = plan_deployment(obs, self.ctx)
        planned = time.perf_counter()

        if plan.labels:
            self.kube.patch(md_path(ns, name), {"metadata": {"labels": plan.labels}})
        refusals: list[str] = []
        for body in ([plan.archive_create] if plan.archive_create is not None else []) + plan.presaves:
            refusals += self._refusal("GraphArchive", self.kube.create, ga_path(ns), body)
        claimed, pods_refused = self._apply_pods(obs, plan, template, started, planned)
        refusals += pods_refused
        refusals += self._apply_hpa(ns, name, plan, obs.hpa)
        refusals += apply_service(self.kube, ns, name, obs.uid, plan.status)
        if refusals:
            record_refusals(obs, plan, refusals, len(pods_refused))

        self._check_placement(obs, template, plan)
        self._yield_warm(obs, template, md)
        metrics.STATE.set_deployment(ns, name, fallback=plan.status.fallback_count,
                                     native=plan.status.native_replicas, warm_ready=plan.status.warm_ready,
                                     warm_loading=plan.status.warm_loading)
        fell_back = [(p.name, p.created, p.restore) for p in obs.pods if p.fell_back]
        metrics.STATE.count_fallbacks(ns, name, fell_back)
        self._patch_status(md_path(ns, name), md.get("status"), plan.status.wire())
        self.post_events(md, plan.events)
        # Pools change when this deployment claimed from one or asks for one, or (spec edits) may
        # have stopped asking: never on every pass of every deployment (that is O(deployments²)).
        spec_changed = status.observed_generation != obs.generation
        if warm_capped := warm_pool_size(spec)[1]:
            capped.append(Event("Warning", "WarmPoolCapped", warm_capped))
        self.post_events(md, self.notices.fresh((ns, name), capped))
        held = None
        if claimed or spec.warm_pool.size or obs.bound or (obs.warm and spec_changed):
            held = self.reconcile_pools(ns)  # a failing pool's replacement waits: look again then
        # Refused: not every 2 s (the same request fails the same way); a spec edit comes at once.
        after = max(60.0, self.settings.resync_seconds) if refusals else plan.requeue_after
        return min((t for t in (after, held) if t), default=after)

    def _yield_warm(self, obs: Observed, template: PodTemplate, md: dict[str, Any]) -> None:
        """Serving pods the scheduler cannot place for want of GPUs take them from idle warm pods
        (`pools.warm_to_yield`); pools of that product wait meanwhile (`reconcile_pools`)."""
        pending = [p for p in obs.pods if gpu_starved(p)]
        widest = placement.largest_node_gpus(self.kube, template.gpu_product) if pending else None
        pending = [p for p in pending if widest is None or p.gpus <= widest]  # others fit nowhere
        if not pending:
            return
        selector = f"{naming.warm_selector()},{contract.LABEL_GPU_PRODUCT}={template.gpu_product}"
        warm = [PodView.of(p) for p in self.kube.list(pods_path(obs.namespace), selector)]
        if any(w.deleting for w in warm):
            return  # a yield is in flight: the scheduler places the pod once those GPUs are free
        names = warm_to_yield(pending, warm, template.pool_key)
        if not names:
            return
        self._parallel(lambda pod: self.kube.delete(pods_path(obs.namespace, pod)), names)
        self.post_events(md, [Event("Normal", "WarmPodsYielded", f"deleted warm pod(s) {', '.join(names)} "
                                    f"so that {len(pending)} pending serving pod(s) get their GPUs")])

    def _left(self, ns: str, meta: dict[str, Any]) -> Left:
        """What the namespace's caps leave for this deployment (no read without such caps)."""
        if not (self.limits.max_namespace_replicas or self.limits.max_namespace_warm_gpus):
            return Left()
        return namespace_left(self.kube.list(md_path(ns)), meta, self.limits)

    def _check_placement(self, obs: Observed, template: PodTemplate, plan: Plan) -> None:
        """The `Schedulable` condition: re-checked on a spec change or while it is not True."""
        old = conditions.get(obs.status.conditions, placement.CONDITION)
        fresh = obs.status.observed_generation == obs.generation
        if old is not None and old.status.value == "True" and fresh:
            problem = None
        else:
            problem = placement.placement_problem(self.kube, obs.namespace, template.gpu_product,
                                                  template.store.pvc)
        # No node or PVC at all, else what the scheduler says about the pods themselves.
        problem = problem or plan.unschedulable
        reason, message = problem or ("Schedulable", "")
        plan.status.conditions = conditions.put(plan.status.conditions, placement.CONDITION, problem is None,
                                                reason, message[:4096], obs.generation, obs.now)
        planned = plan.status.phase
        settle(plan.status, obs.generation, obs.now)
        final = plan.status.phase
        if final != planned:  # the plan's own Phase event named the phase before this
            plan.events = [e for e in plan.events if e.reason != "Phase"]
            if obs.status.phase != final and final in (MDPhase.ready, MDPhase.degraded):
                before = obs.status.phase.value if obs.status.phase else "None"
                plan.events.append(Event("Normal" if final is MDPhase.ready else "Warning", "Phase",
                                         f"phase {before} → {final.value}"))
        if problem is not None and (old is None or old.reason != reason):
            plan.events.append(Event("Warning", reason, message[:1024]))

    def _observe_deployment(
        self, ns: str, name: str, meta: dict[str, Any], spec: ModelDeploymentSpec,
        status: ModelDeploymentStatus, template: PodTemplate,
    ) -> Observed:
        """Everything planning needs, read in parallel (the reads are most of a reconcile's
        latency, and claims wait on them)."""
        ident_hash = spec.identity().hash()
        alts = list(dict.fromkeys(h for shape in spec.parallelism.shapes()[1:]
                                  if (h := spec.identity(shape).hash()) != ident_hash))
        reads: list[Future[Any]] = [
            self.pool.submit(self.kube.get, ga_path(ns, naming.archive_name(ident_hash))),
            self.pool.submit(self.kube.list, pods_path(ns), naming.selector(name)),
            self.pool.submit(self.kube.list, pods_path(ns), naming.warm_selector(template.pool_key)),
            self.pool.submit(self.kube.get, hpa_path(ns, naming.hpa_name(name))),
            self.pool.submit(self.kube.list, pods_path(ns), naming.selector(name, contract.POOL_DRAINING)),
            self.pool.submit(self.kube.list, pods_path(ns), naming.bound_selector(name)),
            *(self.pool.submit(self.kube.get, ga_path(ns, naming.archive_name(h))) for h in alts),
        ]
        ga, pods, warm, hpa, draining, bound, *alt_gas = (r.result() for r in reads)
        pending = self._warm_pending(ns, name, spec, template)
        return Observed(
            name=name, namespace=ns, uid=meta["uid"], generation=int(meta.get("generation") or 0),
            spec=spec, status=status, now=self.clock(), labels=dict(meta.get("labels") or {}),
            archive=ArchiveView.of(ga) if ga else None,
            pods=[PodView.of(p) for p in pods], warm=[PodView.of(p) for p in warm], hpa=hpa,
            draining=[PodView.of(p) for p in draining], bound=[PodView.of(p) for p in bound],
            alt_archives={h: ArchiveView.of(g) if g else None for h, g in zip(alts, alt_gas, strict=True)},
            warm_pending=pending,
        )

    def _warm_pending(
        self, ns: str, name: str, spec: ModelDeploymentSpec, template: PodTemplate,
    ) -> list[PodView]:
        """Warm pods of the deployment's pools (every shape's, its identity-keyed ones too) that the
        scheduler has not placed."""
        if not spec.warm_pool.size:
            return []
        keys = {template.pool_key} | {template_of(ns, spec, self.ctx, shape).pool_key
                                      for shape in spec.parallelism.shapes()[1:]}
        listed = self.kube.request("GET", pods_path(ns), query={
            "labelSelector": naming.warm_selector(), "fieldSelector": "status.phase=Pending",
        }).get("items") or []
        views = [PodView.of(p) for p in listed]
        return [v for v in views if (v.labels.get(contract.LABEL_POOL_KEY) in keys or v.warm_for == name)
                and v.unschedulable]

    def _apply_pods(
        self, obs: Observed, plan: Plan, template: PodTemplate, started: float, planned: float
    ) -> tuple[int, list[str]]:
        """Claims first (they are the fast path), then cold pods for what could not be claimed,
        then deletions. Returns the number of warm pods claimed and the apiserver's refusals."""
        ns, name = obs.namespace, obs.name
        claimed, lost = self._claim(ns, plan.claims, started)
        if plan.claims:
            log.info("ModelDeployment %s/%s claimed %d warm pod(s) (%d lost): read+plan %.0f ms, "
                     "claims %.0f ms", ns, name, claimed, lost, 1000 * (planned - started),
                     1000 * (time.perf_counter() - planned))
        plan.status.warm_claims -= lost
        if claimed:  # the lifetime count at once: a stop or crash before the pass's status write keeps it
            count = {"status": {"warmClaims": plan.status.warm_claims}}
            self.kube.patch(f"{md_path(ns, name)}/status", count)
        creates = list(plan.creates)
        if lost and plan.claim is not None:
            # Pods whose claim was lost to another deployment are made cold instead.
            taken = {p.name for p in obs.pods} | {c["metadata"]["name"] for c in creates}
            creates += [serving_pod(template, plan.claim, pod, obs.uid)
                        for pod in free_names(name, plan.claim.revision, taken, lost)]
        refused = [r for rs in self._parallel(lambda body: self._refusal(
            f"pod {body['metadata']['name']}", self.kube.create, pods_path(ns), body), creates) for r in rs]
        if creates:
            metrics.COLD_PODS_TOTAL.inc(len(creates) - len(refused))
        self._parallel(lambda pod: self.kube.delete(pods_path(ns, pod)), plan.deletes)
        drain = switching.drain_patch(obs.now)
        self._parallel(lambda pod: self._patch_pod(ns, pod, drain), plan.drains)
        self._parallel(lambda pod: self._patch_pod(ns, pod, switching.undrain_patch()), plan.undrains)
        return claimed, refused

    def _apply_hpa(self, ns: str, name: str, plan: Plan, hpa: dict[str, Any] | None) -> list[str]:
        what = f"HorizontalPodAutoscaler {naming.hpa_name(name)}"
        if plan.hpa_apply is not None:
            if hpa is None:
                return self._refusal(what, self.kube.create, hpa_path(ns), plan.hpa_apply)
            return self._refusal(what, self.kube.patch, hpa_path(ns, naming.hpa_name(name)),
                                 {"spec": plan.hpa_apply["spec"]})
        if plan.hpa_delete:
            self.kube.delete(hpa_path(ns, naming.hpa_name(name)))
        return []

    @staticmethod
    def _refusal(what: str, call: Callable[..., Any], *args: Any) -> list[str]:
        """Run one create/patch; [] when done, [why] when the apiserver refused it (4xx other than
        404/409/429: invalid, admission, quota). Anything transient still raises (and retries)."""
        try:
            call(*args)
        except KubeError as exc:
            if not exc.rejected:
                raise
            log.warning("The apiserver refused %s: %s", what, exc)
            return [f"{what} refused by the API server ({exc.status}): {exc.message}"[:512]]
        return []

    def _claim(self, ns: str, claims: list[tuple[str, dict[str, Any]]], started: float) -> tuple[int, int]:
        def one(item: tuple[str, dict[str, Any]]) -> bool:
            pod, patch = item
            t = time.perf_counter()
            try:
                self.kube.patch(pods_path(ns, pod), patch)
                metrics.CLAIM_PATCH_SECONDS.observe(time.perf_counter() - t)
            except KubeError as exc:
                if exc.conflict or exc.not_found:
                    metrics.CLAIMS_TOTAL.labels("lost").inc()
                    return False
                raise
            metrics.CLAIM_SECONDS.observe(time.perf_counter() - started)
            metrics.CLAIMS_TOTAL.labels("claimed").inc()
            return True

        results = self._parallel(one, claims)
        won = sum(results)
        return won, len(results) - won

    def _patch_pod(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        try:
            self.kube.patch(pods_path(ns, name), patch)
        except KubeError as exc:
            if not exc.not_found:
                raise

    def cleanup_deployment(self, ns: str, name: str) -> None:
        """Finalizer: the deployment's pods and HPA go with it (owner references would too, later)."""
        self.kube.delete(hpa_path(ns, naming.hpa_name(name)))
        pods = self.kube.list(pods_path(ns), f"{contract.LABEL_DEPLOYMENT}={name}")
        self._parallel(lambda p: self.kube.delete(pods_path(ns, p["metadata"]["name"])), pods)
        log.info("ModelDeployment %s/%s deleted: removed %d pod(s) and its HPA", ns, name, len(pods))
        metrics.STATE.forget_deployment(ns, name)
        self.notices.said.pop((ns, name), None)
        self.reconcile_pools(ns)

    def deployments_using(self, ns: str, identity_short: str) -> list[str]:
        """Deployments of the identity: serving it, or keeping it as an alternative shape."""
        serving = self.kube.list(md_path(ns), f"{contract.LABEL_IDENTITY}={identity_short}")
        alternative = self.kube.list(md_path(ns), switching.uses_label(identity_short))
        return sorted({m["metadata"]["name"] for m in serving + alternative})

    # ------------------------------------------------------------------ warm pools
    def reconcile_pools(self, ns: str) -> float | None:
        """Every pool of the namespace. A pool the apiserver refuses (a deployment's template is
        rejected: quota, LimitRange, admission policy) is that pool's fault only: the others are
        still reconciled and its deployments get a Warning event. A pool whose pods keep failing
        gets no new pods until its back-off ends (`warm_backoff`): returns the seconds until the
        first such pool may be replenished (None: none is held)."""
        started = time.perf_counter()
        wanted: list[WarmWant] = []
        owners: dict[str, list[dict[str, Any]]] = {}
        mds = self.kube.list(md_path(ns))
        gas = self.kube.list(ga_path(ns)) if mds else []
        archives = {ga["metadata"]["name"]: ArchiveView.of(ga) for ga in gas}
        for md in mds:
            if (md.get("metadata") or {}).get("deletionTimestamp"):
                continue
            try:
                wants = self._pool_wants(ns, md, mds, archives)
            except (ValidationError, ValueError):
                continue  # its own reconcile reports the invalid spec
            wanted += wants
            for key in {want.key for want in wants}:
                owners.setdefault(key, []).append(md)
        managed = self.kube.list(pods_path(ns), f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_OPERATOR}")
        warm = [PodView.of(p) for p in managed
                if (p["metadata"].get("labels") or {}).get(contract.LABEL_POOL) == contract.POOL_WARM]
        plan = plan_pools(wanted, warm, {p["metadata"]["name"] for p in managed})
        self._report_failures(owners, self.warm_backoff.observe(ns, warm))
        held = {key: wait for key in plan.sizes if (wait := self.warm_backoff.wait(ns, key)) > 0}
        self.warm_backoff.forget(ns, set(owners))
        # Serving pods waiting for GPUs come first: no new warm pods of their GPU product meanwhile.
        starved = {v.labels.get(contract.LABEL_GPU_PRODUCT) for v in map(PodView.of, managed)
                   if v.labels.get(contract.LABEL_POOL) == contract.POOL_SERVING and gpu_starved(v)}
        plan.creates = [c for c in plan.creates
                        if c["metadata"]["labels"].get(contract.LABEL_GPU_PRODUCT) not in starved
                        and c["metadata"]["labels"].get(contract.LABEL_POOL_KEY) not in held]
        create = lambda body: self._refused(self.kube.create, pods_path(ns), body)  # noqa: E731
        refused = [e for e in self._parallel(create, plan.creates) if e is not None]
        self._parallel(lambda pod: self._refused(self.kube.delete, pods_path(ns, pod)), plan.deletes)
        self._parallel(lambda item: self._refused(self._patch_pod, ns, *item), plan.patches)
        self._report_pools(ns, owners, {key: str(exc)[:1024] for key, exc in refused})
        metrics.STATE.set_warm_pools(ns, plan.sizes)
        metrics.STATE.set_warm_failures(ns, self.warm_backoff.failures(ns))
        metrics.RECONCILE_SECONDS.labels("WarmPool").observe(time.perf_counter() - started)
        return min(held.values()) if held else None

    def _report_failures(self, owners: dict[str, list[dict[str, Any]]], failures: list[Failure]) -> None:
        """A Warning event on each deployment of a pool whose warm pod just failed."""
        for f in failures:
            note = (f"warm pod {f.pod} failed ({f.count} in a row in pool {f.key[:24]}): {f.reason}; "
                    f"its replacement waits {f.delay_s:.0f}s")
            for md in owners.get(f.key, []):
                self.post_events(md, [Event("Warning", "WarmEngineFailing", note)])

    def _pool_wants(
        self, ns: str, md: dict[str, Any], mds: list[dict[str, Any]], archives: dict[str, ArchiveView],
    ) -> list[WarmWant]:
        """One deployment's pools: identity-keyed for each shape whose archive is Available (the
        pods carry that shape's hand-off data), template-keyed where it is failing (native
        capture), none while it is on its way (`pools.pool_wants`)."""
        meta = md["metadata"]
        spec = apply_limits(ModelDeploymentSpec.model_validate(md.get("spec") or {}), self.limits,
                            namespace_left(mds, meta, self.limits))[0]

        def bind(shape: ShapeSpec) -> Claim | bool | None:
            archive = archives.get(naming.archive_name(spec.identity(shape).hash()))
            if archive is None or not (archive.available or archive.failing):
                return False
            return claim_for(meta["name"], spec, archive, shape=shape) if archive.available else None

        return pool_wants(spec, md.get("status") or {}, lambda shape: template_of(ns, spec, self.ctx, shape),
                          bind, meta.get("uid", ""))

    @staticmethod
    def _refused(call: Callable[..., Any], *args: Any) -> tuple[str, KubeError] | None:
        """Run one pool API call; a request the apiserver refuses (4xx but 409/429) is returned
        with its pool key instead of raised. Transient failures still raise (and retry)."""
        try:
            call(*args)
        except KubeError as exc:
            if exc.status >= 500 or exc.status in (409, 429) or exc.status == 0:
                raise
            body = args[-1] if isinstance(args[-1], dict) else {}
            key = ((body.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_POOL_KEY, "")
            log.warning("Warm pool %s: the apiserver refused %s: %s", key or "?", call.__name__, exc)
            return key, exc
        return None

    def _report_pools(
        self, ns: str, owners: dict[str, list[dict[str, Any]]], refused: dict[str, str],
    ) -> None:
        """A Warning event on each deployment of a refused pool, once per distinct refusal."""
        for key, mds in owners.items():
            message = refused.get(key, "")
            if self._pool_faults.get((ns, key), "") == message:
                continue
            self._pool_faults[(ns, key)] = message
            if message:
                for md in mds:
                    note = f"warm pods of this deployment's pool are refused: {message}"
                    self.post_events(md, [Event("Warning", "WarmPoolRefused", note)])
