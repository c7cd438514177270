"""The restored graphs of one archive, kept alive together, and how they are launched.

One instantiated exec per topology group (its template), or per union template (`unions.py`);
any other graph of the group is served by `cuGraphExecUpdate` of the template exec with that
graph, when the key differs from what the exec holds. Every key then gets an exec of its own
(`own_execs.py`), which serves it from then on. Engines hold `RestoredGraph`s (restored.py).
Everything a restored graph references lives as long as the library: kernel functions (in the
native catalog), prepared argument buffers, events, CUgraphs, execs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cuda.bindings import driver as cu

from ember import settings
from ember.archive.graphs import GraphSet
from ember.archive.table_layout import FormatError
from ember.native import EmberError
from ember.runtime import faults
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.driver import OK, CudaError, check, current_context, launch_exec
from ember.runtime.graphs.groups import (
    Events,
    GraphSource,
    Group,
    LoadTimings,
    SetSource,
    TemplateExec,
    initial_groups,
    split_groups,
    unfolded,
)
from ember.runtime.graphs.kernels import KernelFunctions
from ember.runtime.graphs.need import Dedicator, need_order
from ember.runtime.graphs.own_execs import OwnExecs
from ember.runtime.graphs.prepared import mark_splices
from ember.runtime.graphs.restored import RestoredGraph
from ember.runtime.graphs.unions import UnionTemplate
from ember.runtime.graphs.uploads import Uploader

log = logging.getLogger(__name__)
TEMPLATE_BATCH = 2  # templates per libember call after the first (each batch ready on its own)


class GraphLibrary:
    """All graphs of one graph set: templates, on-demand updates, and each key's own exec (`own`)."""

    def __init__(
        self,
        source: GraphSource | GraphSet,
        functions: list[int] | KernelFunctions,
        *,
        hot_after: int = 1,
        workers: int = 4,
        splicer: Any = None,
    ) -> None:
        """`splicer` (`ember.runtime.comm.Splicer`): this rank's collectives, for an archive
        whose graphs hold collective placeholders (multi-GPU)."""
        self.source: GraphSource = SetSource(source) if isinstance(source, GraphSet) else source
        # resolved (and given their SAVE-time attributes) as the graphs being prepared need them
        if not isinstance(functions, KernelFunctions):
            known = list(functions)
            functions = KernelFunctions(
                len(known), known.__getitem__, self.source.function_attrs, rebuild.apply_function_attr
            )
        self.functions = functions
        self.keys: list[tuple[int, ...]] = [tuple(k) for k in self.source.keys]
        self.unions_refused = ""  # why an archive's union sections were not used (damaged)
        self.groups: list[Group] = initial_groups(self.source, self._unions(splicer))
        self._group_of: dict[int, int] = {m: g.index for g in self.groups for m in g.members}
        self._first_own: int | None = None  # a union's first key: its own exec comes first
        self._index = {k: i for i, k in enumerate(self.keys)}
        self.ctx = current_context()
        self.events = Events()
        # A decoded graph table is prepared straight from its chunks (no Python node objects).
        self._attr_sets = rebuild.AttrSets(self.source) if hasattr(self.source, "chunk") else None
        self._prepared: dict[int, rebuild.PreparedGraph] = {}
        self._graphs: dict[int, Any] = {}
        self._templates: dict[int, TemplateExec] = {}
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ember-prepare")
        self.driver_lock = threading.RLock()
        self.timings = LoadTimings()
        self.switch_ms: list[float] = []
        self.splicer = splicer
        self.splices = splicer.graph if splicer is not None else None
        self._spliced: dict[int, list[tuple[int, int]]] = {} if splicer is None else splicer.collectives.nodes
        self.order = need_order(self.keys)
        self._ready: dict[int, threading.Event] = {}  # per group: its template is instantiated
        self._failed: dict[int, BaseException] = {}  # groups whose background build failed
        self.marks: dict[str, float] = {}  # perf_counter() when: first, templates, dedicated
        self.ready_at: dict[int, float] = {}  # perf_counter() when each group's template was ready
        self.waited_ms: list[float] = []  # launches that waited for their template
        self.uploads = Uploader(self.ctx)
        self._ahead: list[Future[float]] = []  # the union template, prepared during the first build
        self.launches = 0
        self._stale_update, self.own_fault = faults.active("stale-update"), faults.active("own-exec")
        self.own = OwnExecs(self, hot_after)  # each key's own exec (own_execs.py)

    def _unions(self, splicer: Any) -> list[UnionTemplate]:
        """The source's union templates, unless this rank splices collectives into the graphs (a
        placeholder may become another shape per rank) or EMBER_UNION_TEMPLATES=0."""
        if splicer is not None or not settings.on("EMBER_UNION_TEMPLATES"):
            return []
        try:
            return [UnionTemplate(u) for u in getattr(self.source, "unions", ())]
        except FormatError as exc:  # damaged union sections: the topology groups serve
            self.unions_refused = str(exc)
            return []

    # ---- building -----------------------------------------------------------------------
    def key_index(self, key: Iterable[int]) -> int:
        return self._index[tuple(key)]

    def prepared(self, index: int, own: bool = False) -> rebuild.PreparedGraph:
        if own and self.own_fault and self._attr_sets is not None:  # own execs computing otherwise
            return rebuild.prepare_from_table(self.source, index, self.functions, self.ctx, self._attr_sets,
                                              corrupt=True)
        prep = self._prepared.get(index)
        if prep is None:
            if self._attr_sets is not None:
                prep = rebuild.prepare_from_table(
                    self.source, index, self.functions, self.ctx, self._attr_sets
                )
            else:
                prep = rebuild.prepare(self.source.graph(index), self.functions, self.ctx)
            if index in self._spliced:
                mark_splices(prep, self._spliced[index])
            # two threads may prepare one graph (the pool ahead, a launch): all use the first
            prep = self._prepared.setdefault(index, prep)
        return prep

    def graph(self, index: int) -> Any:
        """The (uninstantiated) CUgraph of one graph, built once (libember's builder, else Python)."""
        g = self._graphs.get(index)
        if g is None:
            with self.driver_lock:
                g = self._graphs.get(index)
                if g is None:
                    prep = self.prepared(index)
                    one, _ = rebuild.build_native(
                        [prep], self.ctx, self.events, instantiate=False, threads=1, splices=self.splices
                    )
                    g = one[0][0] if one[0] else rebuild.build(prep, self.ctx, self.events, self.splices)
                    self._graphs[index] = g
        return g

    def build_templates(self) -> None:
        """`build_first` + `build_rest`. Any other key is prepared and built when it is first asked
        for, or by `start_dedicating` (preparing every graph right away made the engine's first
        request wait for the GIL: benchmarks/results/cb-nvidia-h200.md)."""
        self.build_first()
        self.build_rest()

    def build_first(self, before_build: Callable[[], None] | None = None) -> None:
        """The first needed key made launchable: the library can serve it from here on. That is
        its group's template, or where the group is a union, the key's own exec (a union template
        needs every member's kernels; it follows in `build_rest`). `before_build()` runs once it
        is prepared, as libember's builder takes it (no GIL held)."""
        self._regroup()
        self._order_groups()
        if self.groups and self.groups[0].union is not None:
            self._own_first(self.order[0], before_build)
        else:
            self._build_groups(self.groups[:1], raise_errors=True, before_build=before_build)
        self.marks["first"] = time.perf_counter()

    def _own_first(self, index: int, before_build: Callable[[], None] | None) -> None:
        t = time.perf_counter()
        self.prepared(index)
        self.timings.prepare_ms += (time.perf_counter() - t) * 1e3
        if before_build is not None:
            before_build()
        self._ahead = [self.prepare_ahead(groups=self.groups[:1])]  # while libember builds this
        ((_, ex),) = self.own.build([index], self.timings.per_graph)
        self.upload([ex])
        self.own.adopt(index, ex)
        self._first_own = index

    def build_rest(self, *, raise_errors: bool = True) -> None:
        """Every other template, in need order, TEMPLATE_BATCH at a time: each batch is launchable
        as soon as it is built and uploaded (one batch of 24 made the second key wait for the
        25th template). With `raise_errors=False` (the library was handed over already) a group
        that fails is recorded; its first launch builds it again there, except a union template:
        its members go back to their topology groups, built here. The next batch is prepared on
        a pool thread while libember builds this one (its call holds no GIL)."""
        rest = [g for g in self.groups if g.index not in self._ready or not self._ready[g.index].is_set()]
        batches = [rest[i : i + TEMPLATE_BATCH] for i in range(0, len(rest), TEMPLATE_BATCH)]
        behind = settings.on("EMBER_UPLOAD_BEHIND")  # opt-in: not GPU-proven yet
        ahead, self._ahead = self._ahead or [self.prepare_ahead(groups=b) for b in batches[:1]], []
        for n, batch in enumerate(batches):
            self.timings.prepare_ms += sum(f.result() for f in ahead)  # (a failure: met below)
            ahead = [self.prepare_ahead(groups=b) for b in batches[n + 1 : n + 2]]
            self._build_groups(batch, raise_errors=raise_errors, upload_behind=behind)
        self.uploads.drain()  # each batch uploads while the next one builds
        for g in [g for g in rest if g.union is not None and g.index in self._failed]:
            self._unfold(g)
        self.timings.upload_ms, self.timings.upload_call_ms = self.uploads.ms, self.uploads.call_ms
        self.timings.templates = len(self._templates)
        self.timings.function_attrs_ms = self.functions.attrs_ms
        self.marks["templates"] = time.perf_counter()

    def prepare_ahead(self, indices: Sequence[int] = (), groups: Sequence[Group] = ()) -> Future[float]:
        """Prepare these graphs and groups' templates on a pool thread (in the library's context)
        while the caller's builder call runs; a failure is left for the caller's own `prepared()`
        to meet. The future's result: the milliseconds it took."""

        def run() -> float:
            t = time.perf_counter()
            with contextlib.suppress(Exception):
                check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
                for i in indices:
                    self.prepared(i)
                for g in groups:
                    self.template_prepared(g)
            return (time.perf_counter() - t) * 1e3

        return self.pool.submit(run)

    def template_prepared(self, group: Group) -> rebuild.PreparedGraph:
        """What a group's template exec is instantiated from: its template key's graph, or the
        union template."""
        if group.union is None:
            return self.prepared(group.template)
        return group.union.prepared(self.source, self.functions, self.ctx, self._attr_sets)

    def _order_groups(self) -> None:
        """Groups in need order, each with its first needed member as template (so the first key
        of a group runs on an exec instantiated from its own graph; a union's template is its own)."""
        rank = {i: r for r, i in enumerate(self.order)}
        ordered = sorted(self.groups, key=lambda g: min(rank[m] for m in g.members))
        self.groups = [
            Group(n, list(g.members), -1 if g.union is not None else min(g.members, key=rank.__getitem__),
                  g.union)
            for n, g in enumerate(ordered)
        ]
        self._group_of = {m: g.index for g in self.groups for m in g.members}
        self._ready = {g.index: threading.Event() for g in self.groups}

    def _unfold(self, union: Group) -> None:
        """A union template that could not be built: its members get their topology groups'
        templates, built here. A launch waiting for the union wakes and finds its new group."""
        new = unfolded(self.source, union, self.order, len(self.groups))
        for g in new:
            self._ready[g.index] = threading.Event()
        self.groups.extend(new)
        self._group_of.update({m: g.index for g in new for m in g.members})
        self._ready[union.index].set()  # its waiters look up their group again
        for i in range(0, len(new), TEMPLATE_BATCH):
            self._build_groups(new[i : i + TEMPLATE_BATCH], raise_errors=False)

    def _build_groups(
        self, groups: list[Group], *, raise_errors: bool, before_build: Callable[[], None] | None = None,
        upload_behind: bool = False,
    ) -> None:
        """Templates of `groups` in one libember call (one builder thread unless
        EMBER_BUILD_THREADS says otherwise); any it leaves (child graphs, an edge strategy this
        driver needs) are built by the Python path. Uploaded (here, or on the uploader's thread
        with `upload_behind`), then each group's ready event set (a failed union's only once its
        members have their groups again: `_unfold`)."""
        try:
            if groups:
                self._build_template_execs(groups, raise_errors=raise_errors, before_build=before_build)
        except BaseException as exc:
            if raise_errors:
                raise
            for g in groups:
                if g.index not in self._templates:
                    self._failed[g.index] = exc
        finally:
            execs = [self._templates[g.index].handle for g in groups if g.index in self._templates]
            done = [g for g in groups if g.union is None or g.index not in self._failed]

            def ready() -> None:
                now = time.perf_counter()
                for g in done:
                    self.ready_at.setdefault(g.index, now)
                    self._ready[g.index].set()

            if upload_behind:
                self.uploads.behind(execs, ready)
            else:
                self.upload(execs)
                ready()

    def _build_template_execs(
        self, groups: list[Group], *, raise_errors: bool = True,
        before_build: Callable[[], None] | None = None,
    ) -> None:
        t = time.perf_counter()
        preps, prepared = [], []
        for g in groups:
            try:
                preps.append(self.template_prepared(g))
                prepared.append(g)
            except Exception as exc:  # e.g. a kernel its image does not hold: this group only
                if raise_errors:
                    raise
                self._failed[g.index] = exc
        groups = prepared
        self.timings.prepare_ms += (time.perf_counter() - t) * 1e3
        if before_build is not None:
            before_build()
        if not groups:
            return
        nodes = [g.union.nodes if g.union is not None else None for g in groups]
        with self.driver_lock:
            built, nt = rebuild.build_native(
                preps, self.ctx, self.events, instantiate=True, splices=self.splices, nodes_out=nodes
            )
        self.timings.native_ms += nt["wall_ms"]
        self.timings.threads = int(nt["threads"])
        self.timings.build_ms += nt["build_cpu_ms"]
        self.timings.instantiate_ms += nt["instantiate_cpu_ms"]
        self.timings.per_graph += nt["per_graph"]
        for group, pair in zip(groups, built, strict=True):
            if pair is None:
                self._template_here(group)
            elif group.union is not None:
                group.union.graph = pair[0]
                self._templates[group.index] = TemplateExec(pair[1], -1)
            else:
                self._graphs[group.template] = pair[0]
                self._templates[group.index] = TemplateExec(pair[1], group.template)

    def _template_here(self, group: Group) -> None:
        """One template by the Python path (what libember's builder leaves, or a retry)."""
        t = time.perf_counter()
        if group.union is not None:
            prep = self.template_prepared(group)
            g = group.union.graph = rebuild.build(prep, self.ctx, self.events, nodes_out=group.union.nodes)
        else:
            g = self.graph(group.template)
        t0 = time.perf_counter()
        with self.driver_lock:
            handle = rebuild.instantiate(g)
        self.timings.build_ms += (t0 - t) * 1e3
        self.timings.instantiate_ms += (time.perf_counter() - t0) * 1e3
        self._templates[group.index] = TemplateExec(handle, group.template)

    def upload(self, execs: list[Any]) -> None:
        """Upload execs to the device now, and wait for it (`ember.runtime.graphs.uploads`)."""
        self.uploads.upload(execs)

    def _regroup(self) -> None:
        """Split topology groups by the shapes of this rank's collectives (see split_groups)."""
        if self.splicer is None:
            return
        t = time.perf_counter()
        self.groups = split_groups(self.groups, self._spliced, self.splicer.signature)  # then _order_groups
        self.timings.splice_ms = (time.perf_counter() - t) * 1e3

    def prebuild_all(self) -> None:
        """Build every graph's CUgraph now (SAVE's proof and benchmarks; LOAD does it lazily)."""
        for i in range(len(self.keys)):
            self.graph(i)

    def start_dedicating(self, after: Iterable[threading.Event] = (), budget: int | None = None) -> Dedicator:
        """Every key's own exec, in need order, on a background thread that starts once `after`
        are set and the templates are built (`ember.runtime.graphs.need.Dedicator`)."""
        return self.own.start([*self._ready.values(), *after], budget)

    def wait_templates(self, timeout: float | None = None) -> bool:
        """Wait until every group's template is built (or failed: built again at its first launch;
        a union that failed: its members' topology groups, added meanwhile, too)."""
        while True:
            events = list(self._ready.values())
            if not all(ev.wait(timeout) for ev in events):
                return False
            if len(self._ready) == len(events):
                return True

    def launchable_at(self, index: int) -> float | None:
        """perf_counter() when key `index` became launchable (its group's template built and
        uploaded, through an exec update; a union's first key: its own exec), else None."""
        if index == self._first_own:
            return self.marks.get("first")
        return self.ready_at.get(self._group_of[index])

    def failed_templates(self) -> list[str]:
        """Templates not built in the background (tried again at their first launch), and why."""
        return [f"{self.groups[gi].name(self.keys)}: {type(e).__name__}: {e}"[:300]
                for gi, e in sorted(self._failed.items())]

    def group_members(self, index: int) -> list[int]:
        return list(self.groups[self._group_of[index]].members)

    def is_template(self, index: int) -> bool:
        return self.groups[self._group_of[index]].template == index

    def template_switched(self, index: int) -> bool:
        """The template exec of `index`'s group no longer holds what it was instantiated from."""
        tmpl = self._templates.get(self._group_of[index])
        return tmpl is not None and tmpl.updated

    def keep_graph(self, index: int, g: Any) -> None:
        """A graph built beside an own exec: kept as the key's graph unless one is, or the own
        execs are built corrupt (the `own-exec` fault: the templates' exec updates would load it
        too, and the fault would not be the own execs' alone); else destroyed."""
        with self.driver_lock:
            if index in self._graphs or self.own_fault:
                cu.cuGraphDestroy(g)
            else:
                self._graphs[index] = g

    # ---- launching ----------------------------------------------------------------------
    def restored(self, key: Iterable[int]) -> RestoredGraph:
        return RestoredGraph(self, self.key_index(key))

    def all_restored(self) -> dict[tuple[int, ...], RestoredGraph]:
        return {k: RestoredGraph(self, i) for i, k in enumerate(self.keys)}

    def exec_for(self, index: int) -> Any:
        """An exec that holds graph `index` now: dedicated, or the group template (updated if needed)."""
        ex = self.own.execs.get(index)
        if ex is not None:
            return ex
        tmpl = self._template_of(index)
        if tmpl.holds != index:
            try:
                self.switch(index)
            except (FormatError, CudaError, EmberError) as exc:
                if self.groups[self._group_of[index]].union is None:
                    raise
                # a union member that does not match its slots, or whose switch the driver refused
                log.warning("Graph %s: its own exec, not its union template (%s)", self.keys[index], exc)
                return self.own.instantiate(index)
        if tmpl.updated:
            self.own.used_through_template(index)
        return tmpl.handle

    def _template_of(self, index: int) -> TemplateExec:
        """The group template of `index`, once built and uploaded (a launch or an update racing
        its upload is undefined): a launch may come before that (waits, `waited_ms`), or after
        the build failed (built here, or CudaError)."""
        gi = self._group_of[index]
        if (tmpl := self._templates.get(gi)) is not None and self._ready[gi].is_set():
            return tmpl
        t = time.perf_counter()
        self._ready[gi].wait()
        self.waited_ms.append((time.perf_counter() - t) * 1e3)
        if self._group_of[index] != gi:  # a union that failed: its members have groups of their own
            return self._template_of(index)
        if gi in self._failed:
            with self.driver_lock:
                if gi not in self._templates:
                    self._template_here(self.groups[gi])
                    self._failed.pop(gi, None)
        return self._templates[gi]

    def switch(self, index: int) -> float:
        """Load graph `index` into its group's template exec; returns the update's milliseconds."""
        tmpl = self._template_of(index)
        union = self.groups[self._group_of[index]].union
        if union is not None:
            union.check_member(self.source, index)  # FormatError: damaged, not to be switched in
        g = union.graph_of(self, index) if union is not None else self.graph(index)
        if self._stale_update and tmpl.holds >= 0:  # an injected fault (ember.runtime.faults)
            g = union.graph_of(self, tmpl.holds) if union is not None else self.graph(tmpl.holds)
        with self.driver_lock:
            t = time.perf_counter()
            tmpl.holds = -1  # no key until the update (and a union's mask) is in: a failure leaves none
            err, info = cu.cuGraphExecUpdate(tmpl.handle, g)
            if err != OK:
                result = getattr(info, "result", info)
                raise CudaError(f"cuGraphExecUpdate(graph {self.keys[index]})", f"{err} ({result})")
            if union is not None:
                union.enable(tmpl.handle, index)  # the kernel slots it lacks off, all others on
            ms = (time.perf_counter() - t) * 1e3
            tmpl.holds, tmpl.updated = index, True
        self.switch_ms.append(ms)
        return ms

    def launch(self, index: int, stream: Any = None) -> None:
        self.own.swap_in(self.launches)
        ex = self.exec_for(index)
        self.launches += 1
        launch_exec(ex, stream, f"cuGraphLaunch(graph {self.keys[index]})")

    def launch_template(self, index: int, stream: Any = None) -> None:
        """Launch through the group template (never the dedicated exec): SAVE's proof uses it."""
        tmpl = self._template_of(index)
        if tmpl.holds != index:
            self.switch(index)
        launch_exec(tmpl.handle, stream)

    # ---- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        self.own.stop()
        self.pool.shutdown(wait=True)
        with self.driver_lock:
            self.own.destroy()
            for t in self._templates.values():
                cu.cuGraphExecDestroy(t.handle)
            for g in self._graphs.values():
                cu.cuGraphDestroy(g)
            for group in self.groups:
                if group.union is not None:
                    group.union.destroy()
            self.events.destroy()
            self.uploads.close()
            if self.splicer is not None:
                self.splicer.close()
            self._templates.clear()
            self._graphs.clear()

