"""kopf handlers: the only module that imports kopf. Each handler is a line or two over `Runner`.

ModelDeployment and GraphArchive: create, update, resume and a resync loop all reach the same
idempotent reconcile. Watch events of pods (label `ember.dev/deployment`), SAVE Jobs (label
`ember.dev/archive`) and GraphArchives poke the owning object, so status follows the cluster
within a watch round-trip instead of a resync tick.

No object gets a finalizer: kopf timers and non-optional delete handlers would add one, and a
namespace then stays Terminating while no operator runs. What a deployment owns (pods, HPA) and
what an archive owns (SAVE Jobs) carry owner references, so the garbage collector removes them;
a deployment's DELETED watch event only rebalances the warm pools, which is best effort (the next
resync does it too). The resync loop (every `resync_seconds`) replaces kopf timers; it pauses
while kopf peering says another replica leads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from ember import contract
from ember_operator import metrics, resync
from ember_operator.kube import Kube, KubeError
from ember_operator.reconcilers import Reconciler
from ember_operator.settings import Settings

log = logging.getLogger("ember_operator")
MD = (contract.GROUP, contract.VERSION, contract.MODEL_DEPLOYMENTS)
GA = (contract.GROUP, contract.VERSION, contract.GRAPH_ARCHIVES)
KOPF_PREFIX = f"kopf.{contract.GROUP}"  # kopf's own annotations on our objects


class Runner:
    """Serializes reconciles per object and coalesces pokes that arrive while one runs."""

    def __init__(self, fn: Callable[[str, str], Any]) -> None:
        self.fn = fn
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
            return await asyncio.get_running_loop().run_in_executor(None, self.fn, ns, name)

    def poke(self, ns: str, name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._safe(ns, name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def poke_later(self, ns: str, name: str, delay: float) -> None:
        key = (ns, name)
        if key in self.timers:
            self.timers[key].cancel()
        loop = asyncio.get_running_loop()
        self.timers[key] = loop.call_later(delay, lambda: (self.timers.pop(key, None), self.poke(ns, name)))

    async def _safe(self, ns: str, name: str) -> None:
        try:
            result = await self.run(ns, name)
        except KubeError as exc:
            log.warning("Reconcile of %s/%s failed (retrying in 2s): %s", ns, name, exc)
            self.poke_later(ns, name, 2.0)
            return
        except Exception:
            log.exception("Reconcile of %s/%s failed (retrying in 5s)", ns, name)
            self.poke_later(ns, name, 5.0)
            return
        if isinstance(result, int | float) and result > 0:
            self.poke_later(ns, name, float(result))


async def _reconcile(runner: Runner, namespace: str, name: str) -> None:
    """A kopf handler's reconcile: API errors retry through kopf, a returned delay requeues."""
    try:
        delay = await runner.run(namespace, name)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=2) from exc
    if isinstance(delay, int | float) and delay > 0:
        runner.poke_later(namespace, name, float(delay))


# long: a flat list of kopf handler registrations; kopf names handlers by qualname (register.<locals>.x)
def register(registry: kopf.OperatorRegistry, settings: Settings, kube: Kube | None = None) -> Reconciler:
    """Register every handler on `registry`; returns the reconciler they share."""
    rec = Reconciler(kube or Kube(pool_size=max(32, settings.claim_concurrency * 2)), settings)
    deployments = Runner(rec.reconcile_deployment)
    archives = Runner(rec.reconcile_archive)
    interval = settings.resync_seconds

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Our registry replaces kopf's default one, so its default login handler too.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=32, thread_name_prefix="ember-reconcile")
        )
        metrics.serve(rec.settings.metrics_port, rec.settings.metrics_host)
        log.info("Operator started: metrics on :%s, default store %r", rec.settings.metrics_port,
                 rec.settings.default_store)
        task = asyncio.get_running_loop().create_task(_resync(rec, deployments, archives, interval))
        deployments.tasks.add(task)  # a reference, so the loop is not garbage-collected

    @kopf.on.create(*MD, registry=registry)
    @kopf.on.update(*MD, registry=registry)
    @kopf.on.resume(*MD, registry=registry)
    async def md_changed(namespace: str, name: str, **_: Any) -> None:
        await _reconcile(deployments, namespace, name)

    @kopf.on.event(*MD, registry=registry)
    async def md_event(namespace: str, name: str, type: str | None, **_: Any) -> None:
        if type == "DELETED":  # owner references remove its pods and HPA; pools rebalance now
            await asyncio.get_running_loop().run_in_executor(None, rec.cleanup_deployment, namespace, name)

    @kopf.on.create(*GA, registry=registry)
    @kopf.on.update(*GA, registry=registry)
    @kopf.on.resume(*GA, registry=registry)
    async def ga_changed(namespace: str, name: str, **_: Any) -> None:
        await _reconcile(archives, namespace, name)

    @kopf.on.event(*GA, registry=registry)
    async def ga_event(namespace: str, labels: dict[str, str], type: str | None, **_: Any) -> None:
        # Status changes of an archive move the deployments that use it.
        short = labels.get(contract.LABEL_IDENTITY)
        if short and type in ("MODIFIED", "ADDED", None):
            loop = asyncio.get_running_loop()
            users = await loop.run_in_executor(None, rec.deployments_using, namespace, short)
            for md in users:
                deployments.poke(namespace, md)

    @kopf.on.event("batch", "v1", "jobs", labels={contract.LABEL_ARCHIVE: kopf.PRESENT}, registry=registry)
    async def job_event(namespace: str, labels: dict[str, str], **_: Any) -> None:
        archives.poke(namespace, labels[contract.LABEL_ARCHIVE])

    ours = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_OPERATOR}

    @kopf.on.event("", "v1", "pods", labels=ours, registry=registry)
    async def pod_event(namespace: str, labels: dict[str, str], type: str | None, **_: Any) -> None:
        md = labels.get(contract.LABEL_DEPLOYMENT)
        if md:
            deployments.poke(namespace, md)
        elif labels.get(contract.LABEL_POOL) == contract.POOL_WARM and type == "DELETED":
            await asyncio.get_running_loop().run_in_executor(None, rec.reconcile_pools, namespace)

    return rec


async def _resync(rec: Reconciler, deployments: Runner, archives: Runner, interval: float) -> None:
    """Every `interval`: poke every ModelDeployment and GraphArchive (level-based safety net)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            if not await loop.run_in_executor(None, resync.leading, rec.kube, rec.settings):
                continue
            for runner, plural in ((deployments, contract.MODEL_DEPLOYMENTS),
                                   (archives, contract.GRAPH_ARCHIVES)):
                names = await loop.run_in_executor(None, resync.list_names, rec.kube, rec.settings, plural)
                for ns, name in names:
                    runner.poke(ns, name)
        except Exception:  # the loop must outlive any one failure
            log.exception("Resync failed (next in %.0fs)", interval)


def configure(settings: kopf.OperatorSettings, ours: Settings) -> kopf.OperatorSettings:
    """kopf settings: our finalizer and annotation prefixes, quick batching, peering."""
    settings.persistence.finalizer = contract.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration",
    )
    settings.posting.level = logging.WARNING  # our own events are posted by the reconcilers
    settings.queueing.batch_window = ours.batch_window_seconds
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.peering.name = ours.peering_name
    settings.peering.priority = ours.priority
    settings.peering.standalone = ours.standalone
    settings.peering.mandatory = False
    settings.execution.max_workers = 32
    return settings
