"""kopf handlers: the only module that imports kopf. Each handler is a line or two over `Runner`.

ModelDeployment and GraphArchive watch events, and a resync loop, all reach the same idempotent
reconcile. Watch events of pods (label `ember.dev/deployment`), SAVE Jobs (label
`ember.dev/archive`) and GraphArchives poke the owning object, so status follows the cluster
within a watch round-trip instead of a resync tick.

Only raw watch-event handlers are used: kopf's create/update/resume handlers write bookkeeping
annotations onto every object (a standby replica would write too), and kopf timers and
non-optional delete handlers add finalizers (a namespace then stays Terminating while no operator
runs). What a deployment owns (pods, HPA) and what an archive owns (SAVE Jobs) carry owner
references, so the garbage collector removes them; a deployment's DELETED event only rebalances
the warm pools, which is best effort (the next resync does it too).

Exactly one replica reconciles: the holder of the Lease (`leader.LeaderElector`). Every replica
watches, but a standby drops what it sees; when it takes the Lease over it resyncs everything
at once (level-based reconciles need no history). `standalone` skips the election.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from ember import contract
from ember_operator import metrics, resync
from ember_operator.kube import Kube, KubeError
from ember_operator.leader import LeaderElector
from ember_operator.reconcilers import Reconciler
from ember_operator.settings import Settings

log = logging.getLogger("ember_operator")
MD = (contract.GROUP, contract.VERSION, contract.MODEL_DEPLOYMENTS)
GA = (contract.GROUP, contract.VERSION, contract.GRAPH_ARCHIVES)
KOPF_PREFIX = f"kopf.{contract.GROUP}"  # kopf's own annotations on our objects


class Runner:
    """Serializes reconciles per object and coalesces pokes that arrive while one runs."""

    def __init__(self, fn: Callable[[str, str], Any], leading: Callable[[], bool] = lambda: True) -> None:
        self.fn = fn
        self.leading = leading  # a standby replica drops every poke
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.dirty: set[tuple[str, str]] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.timers: dict[tuple[str, str], asyncio.TimerHandle] = {}

    async def run(self, ns: str, name: str) -> Any:
        key = (ns, name)
        lock = self.locks.setdefault(key, asyncio.Lock())
        self.dirty.add(key)
        async with lock:
            if key not in self.dirty:
                return None  # a run that started after our poke already covered it
            self.dirty.discard(key)
            if not self.leading():
                return None
            return await asyncio.get_running_loop().run_in_executor(None, self.fn, ns, name)

    def poke(self, ns: str, name: str) -> None:
        if not self.leading():
            return
        task = asyncio.get_running_loop().create_task(self._safe(ns, name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def poke_later(self, ns: str, name: str, delay: float) -> None:
        key = (ns, name)
        if key in self.timers:
            self.timers[key].cancel()
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self.timers.pop(key, None)
            self.poke(ns, name)

        self.timers[key] = loop.call_later(delay, fire)

    def stop(self) -> None:
        """Cancel what is scheduled or awaited (the operator stops: kopf would wait 5 s for these
        tasks before cancelling them itself). A reconcile thread in flight ends with its API
        requests (`Kube.stop`)."""
        for timer in self.timers.values():
            timer.cancel()
        for task in self.tasks:
            task.cancel()

    async def _safe(self, ns: str, name: str) -> None:
        try:
            result = await self.run(ns, name)
        except KubeError as exc:
            if exc.stopping:  # the pass ended for the stop signal: nothing to retry
                return
            log.warning("Reconcile of %s/%s failed (retrying in 2s): %s", ns, name, exc)
            self.poke_later(ns, name, 2.0)
            return
        except Exception:
            log.exception("Reconcile of %s/%s failed (retrying in 5s)", ns, name)
            self.poke_later(ns, name, 5.0)
            return
        if isinstance(result, int | float) and result > 0:
            self.poke_later(ns, name, float(result))


def _fresh(body: Mapping[str, Any], type_: str | None) -> bool:
    """Whether a watch event may need a reconcile: not a MODIFIED event whose spec generation the
    status has already seen (our own status writes come back as such events)."""
    if type_ != "MODIFIED":
        return True
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return meta.get("generation") != status.get("observedGeneration")


def elector_of(kube: Kube, settings: Settings) -> LeaderElector | None:
    """The Lease candidate of this process (None when standalone)."""
    if settings.standalone:
        return None
    identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return LeaderElector(kube, settings.lease_home(), settings.lease_name, identity,
                         duration_s=settings.lease_duration_seconds)


# long: a flat list of kopf handler registrations; kopf names handlers by qualname (register.<locals>.x)
def register(registry: kopf.OperatorRegistry, settings: Settings, kube: Kube | None = None) -> Reconciler:
    """Register every handler on `registry`; returns the reconciler they share."""
    rec = Reconciler(kube or Kube(pool_size=max(32, settings.claim_concurrency * 2)), settings)
    elector = elector_of(rec.kube, settings)
    leading = (lambda: True) if elector is None else (lambda: elector.leading)
    metrics.STATE.leading = leading  # a standby exports no state gauges
    deployments = Runner(rec.reconcile_deployment, leading)
    archives = Runner(rec.reconcile_archive, leading)
    interval = settings.resync_seconds

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        if leading():
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return None

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Our registry replaces kopf's default one, so its default login handler too.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="ember-reconcile"))
        metrics.serve(rec.settings.metrics_port, rec.settings.metrics_host)
        log.info("Operator started: metrics on :%s, default store %r, %s", rec.settings.metrics_port,
                 rec.settings.default_store, "standalone" if elector is None else
                 f"electing through Lease {elector.namespace}/{elector.name} as {elector.identity}")
        resync_all = _resync_all(rec, deployments, archives)
        tasks = [loop.create_task(_resync(resync_all, leading, interval))]
        if elector is not None:
            tasks.append(loop.create_task(_elect(elector, resync_all, rec.settings.lease_retry_seconds)))
        deployments.tasks.update(tasks)  # references, so the loops are not garbage-collected

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if elector is not None:
            await asyncio.get_running_loop().run_in_executor(None, elector.release)
        rec.kube.stop()  # a pass in progress ends with its in-flight requests (the grace period)
        deployments.stop()  # the resync and election loops too (kept with the deployments' tasks)
        archives.stop()

    @kopf.on.event(*MD, registry=registry)
    async def md_event(namespace: str | None, name: str, body: Mapping[str, Any], type: str | None,
                       **_: Any) -> None:
        assert namespace is not None  # a namespaced kind
        if type == "DELETED":  # owner references remove its pods and HPA; pools rebalance now
            await off_loop(rec.cleanup_deployment, namespace, name)
        elif _fresh(body, type):
            deployments.poke(namespace, name)

    @kopf.on.event(*GA, registry=registry)
    async def ga_event(namespace: str | None, name: str, labels: Mapping[str, str], body: Mapping[str, Any],
                       type: str | None, **_: Any) -> None:
        assert namespace is not None  # a namespaced kind
        if type != "DELETED" and _fresh(body, type):
            archives.poke(namespace, name)
        # Status changes of an archive move the deployments that use it.
        short = labels.get(contract.LABEL_IDENTITY)
        if short and type in ("MODIFIED", "ADDED", None):
            for md in await off_loop(rec.deployments_using, namespace, short) or []:
                deployments.poke(namespace, md)

    @kopf.on.event("batch", "v1", "jobs", labels={contract.LABEL_ARCHIVE: kopf.PRESENT}, registry=registry)
    async def job_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        assert namespace is not None  # a namespaced kind
        archives.poke(namespace, labels[contract.LABEL_ARCHIVE])

    ours = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR}

    @kopf.on.event("", "v1", "pods", labels=ours, registry=registry)
    async def pod_event(namespace: str | None, labels: Mapping[str, str], type: str | None, **_: Any) -> None:
        assert namespace is not None  # a namespaced kind
        md = labels.get(contract.LABEL_DEPLOYMENT) or labels.get(contract.LABEL_WARM_FOR)
        if md:  # its serving pods, and its identity-keyed warm pods (engine state, crashes)
            deployments.poke(namespace, md)
        elif labels.get(contract.LABEL_POOL) == contract.POOL_WARM and type == "DELETED":
            await off_loop(rec.reconcile_pools, namespace)

    return rec


def _resync_all(rec: Reconciler, deployments: Runner, archives: Runner) -> Callable[[], Any]:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        kinds = ((deployments, contract.MODEL_DEPLOYMENTS), (archives, contract.GRAPH_ARCHIVES))
        for runner, plural in kinds:
            names = await loop.run_in_executor(None, resync.list_names, rec.kube, rec.settings, plural)
            for ns, name in names:
                runner.poke(ns, name)
    return run


async def _resync(resync_all: Callable[[], Any], leading: Callable[[], bool], interval: float) -> None:
    """Every `interval`: poke every ModelDeployment and GraphArchive (level-based safety net)."""
    while True:
        await asyncio.sleep(interval)
        try:
            if leading():
                await resync_all()
        except Exception:  # the loop must outlive any one failure
            log.exception("Resync failed (next in %.0fs)", interval)


async def _elect(elector: LeaderElector, resync_all: Callable[[], Any], retry_s: float) -> None:
    """Every `retry_s`: one election round; on taking the lead, reconcile everything now (what a
    standby dropped, or what changed while nobody led)."""
    loop = asyncio.get_running_loop()
    was = False
    while True:
        try:
            now = await loop.run_in_executor(None, elector.step)
            if now and not was:
                metrics.STATE.clear()  # what it saw when it last led is stale: reconciles refill it
                await resync_all()
            was = now
        except Exception:  # the loop must outlive any one failure
            log.exception("Leader election round failed (next in %.1fs)", retry_s)
        await asyncio.sleep(retry_s)


API_RETRY_MAX_S = 10.0  # the longest wait between two tries of one API request of kopf's


class ApiRetries:
    """kopf's delays between tries of a failed API request (connection, 5xx, 403, 429): 1, 2, 4, 8,
    then every API_RETRY_MAX_S, never exhausted. kopf gives a request up once its delays run out,
    and a watcher that gives up stops the whole operator: with kopf's default (54 s in all) an
    apiserver answering 503 for a minute made the operator exit. It keeps trying instead and
    resumes within API_RETRY_MAX_S of the apiserver's return: a restart would meet the same
    outage, and crash-loop back-off would only delay the recovery. (A leader that cannot renew
    its Lease meanwhile stops reconciling, `leader.py`.)"""

    def __iter__(self) -> Iterator[float]:
        delay = 1.0
        while True:
            yield delay
            delay = min(2 * delay, API_RETRY_MAX_S)


def configure(settings: kopf.OperatorSettings, ours: Settings) -> kopf.OperatorSettings:
    """kopf settings: our annotation prefixes, quick batching, API requests retried for ever
    (`ApiRetries`); kopf's own peering is off (the Lease election in `leader` decides who
    reconciles)."""
    settings.persistence.finalizer = contract.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration",
    )
    settings.posting.level = logging.WARNING  # our own events are posted by the reconcilers
    # kopf's per-object workers live this long after their last event, and kopf waits up to 5 s
    # for them on a stop signal: with a pod event each per pod of a batch, the whole 5 s.
    settings.queueing.idle_timeout = 1.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.execution.max_workers = 32
    settings.networking.error_backoffs = ApiRetries()
    return settings
