"""The restored graphs of one archive, kept alive together, and how they are launched.

One instantiated exec per topology group (its template); any other graph of the group is
served by `cuGraphExecUpdate` of the template exec with that graph (the update is on demand,
when the key differs from what the exec holds now). A key the template was switched to gets a
dedicated exec, instantiated from its own graph in the background after `hot_after` launches
through an updated template (default one): on H100 an exec updated to a graph ran its decode
step up to 24 % slower than an exec instantiated from that same graph (gemma3, B=1: 10.536 vs
8.509 ms, benchmarks/results/graphs-NVIDIA_H100_80GB_HBM3-20261122-114613.md; one exec measured
both ways: benchmarks/results/switch-diag-H100-20261122-qwen3-8b.json), so the template only
bridges a key's first steps.

`RestoredGraph` is the small object engines hold: `replay(stream=None)` and `reset()`, like
torch.cuda.CUDAGraph (transformers' continuous batching registry calls exactly these two).

Everything a restored graph references stays alive as long as the library: kernel functions
(held by the native catalog), prepared argument buffers, events, CUgraphs, execs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from cuda.bindings import driver as cu

from ember.archive.graphs import FunctionAttrs, Graph, GraphSet, KernelRef
from ember.archive.topology import group_graphs
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.driver import OK, CudaError, check, current_context, torch_stream_handle
from ember.runtime.graphs.prepared import mark_splices


class GraphSource(Protocol):
    """What the library reads graphs from: a GraphSet (via SetSource) or a lazily decoded
    `ember.archive.graph_table.GraphTable`."""

    @property
    def keys(self) -> list[tuple[int, ...]]: ...
    @property
    def kernels(self) -> list[KernelRef]: ...
    @property
    def function_attrs(self) -> list[FunctionAttrs]: ...
    @property
    def groups(self) -> Sequence[Any]: ...  # each with .index, .members, .template

    def graph(self, i: int) -> Graph: ...


class SetSource:
    """A GraphSet (in memory) as a GraphSource; groups by topology signature."""

    def __init__(self, graph_set: GraphSet) -> None:
        self.graph_set = graph_set
        self.keys = [tuple(g.key) for g in graph_set.graphs]
        self.kernels = graph_set.kernels
        self.function_attrs = graph_set.function_attrs
        self.groups = group_graphs(graph_set.graphs, graph_set.function_attrs)

    def graph(self, i: int) -> Graph:
        return self.graph_set.graphs[i]


class _Events:
    """Fresh CUevents, created on first use by index (LOAD never scans all graphs for them)."""

    def __init__(self) -> None:
        self._events: dict[int, Any] = {}

    def __getitem__(self, i: int) -> Any:
        ev = self._events.get(i)
        if ev is None:
            ev = self._events[i] = rebuild.create_events(1)[0]
        return ev

    def destroy(self) -> None:
        for ev in self._events.values():
            cu.cuEventDestroy(ev)
        self._events.clear()


@dataclass
class _Group:
    index: int
    members: list[int]
    template: int


@dataclass
class _Exec:
    handle: Any
    holds: int  # graph index currently loaded into the exec
    lock: threading.Lock = field(default_factory=threading.Lock)
    updated: bool = False  # exec-updated at least once (no longer as instantiated)


@dataclass
class LoadTimings:
    """Where building the templates went. With libember's builder, `native_ms` is the wall time
    of its call on `threads` builder threads and build/instantiate_ms the summed per-graph times
    (equal to the wall time on one thread, larger when several overlap)."""

    prepare_ms: float = 0.0
    build_ms: float = 0.0
    instantiate_ms: float = 0.0
    native_ms: float = 0.0
    threads: int = 0
    function_attrs_ms: float = 0.0
    templates: int = 0
    splice_ms: float = 0.0  # capturing this rank's collectives and regrouping (multi-GPU)


class RestoredGraph:
    """A graph of the library under its engine key. Same surface as torch.cuda.CUDAGraph's replay/reset."""

    def __init__(self, library: GraphLibrary, index: int) -> None:
        self._library = library
        self.index = index
        self.key = library.keys[index]

    def replay(self, stream: Any = None) -> None:
        self._library.launch(self.index, stream)

    def reset(self) -> None:
        """Drop this key's dedicated exec, if any (the template stays, it serves the group)."""
        self._library.drop_dedicated(self.index)

    def __repr__(self) -> str:
        return f"RestoredGraph(key={self.key})"


def split_groups(
    groups: Sequence[Any], spliced: dict[int, list[tuple[int, int]]], shape: Any
) -> list[_Group]:
    """Topology groups split so that members also agree on the shapes (`shape(i)`: node types of
    collective i's graph on this rank) of the collectives spliced into them: NCCL may pick another
    algorithm for another message size, and a template exec only takes graphs of its topology.
    A group keeps its template where it can."""
    out: list[_Group] = []
    for g in groups:
        parts: dict[tuple[Any, ...], list[int]] = {}
        for m in g.members:
            parts.setdefault(tuple(shape(i) for _, i in spliced.get(m, [])), []).append(m)
        for members in parts.values():
            out.append(_Group(len(out), members, g.template if g.template in members else members[0]))
    return out


class GraphLibrary:
    """All graphs of one graph set: templates, on-demand updates, dedicated execs."""

    def __init__(
        self,
        source: GraphSource | GraphSet,
        functions: list[int],
        *,
        hot_after: int = 1,
        workers: int = 4,
        splicer: Any = None,
    ) -> None:
        """`splicer` (`ember.runtime.comm.Splicer`): this rank's collectives, for an archive
        whose graphs hold collective placeholders (multi-GPU)."""
        self.source: GraphSource = SetSource(source) if isinstance(source, GraphSet) else source
        self.functions = functions
        self.keys: list[tuple[int, ...]] = [tuple(k) for k in self.source.keys]
        self.groups = list(self.source.groups)
        self._group_of: dict[int, int] = {m: g.index for g in self.groups for m in g.members}
        self._index = {k: i for i, k in enumerate(self.keys)}
        self.ctx = current_context()
        self.events = _Events()
        # A decoded graph table is prepared straight from its chunks (no Python node objects).
        self._attr_sets = rebuild.AttrSets(self.source) if hasattr(self.source, "chunk") else None
        self._prepared: dict[int, rebuild.PreparedGraph] = {}
        self._graphs: dict[int, Any] = {}
        self._templates: dict[int, _Exec] = {}
        self._dedicated: dict[int, Any] = {}
        self._uses: Counter[int] = Counter()  # launches through an updated template, per key
        self._hot_after = hot_after
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ember-prepare")
        self._pending: list[Future[None]] = []
        self._asked: set[int] = set()  # keys whose dedicated exec was asked for
        self._driver_lock = threading.RLock()
        self._background: threading.Thread | None = None
        self.timings = LoadTimings()
        self.switch_ms: list[float] = []
        self.splicer = splicer
        self._splices = splicer.graph if splicer is not None else None
        self._spliced: dict[int, list[tuple[int, int]]] = {}
        if splicer is not None:
            self._spliced = splicer.collectives.nodes

    # ---- building -----------------------------------------------------------------------
    def key_index(self, key: Iterable[int]) -> int:
        return self._index[tuple(key)]

    def prepared(self, index: int) -> rebuild.PreparedGraph:
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
            self._prepared[index] = prep
        return prep

    def graph(self, index: int) -> Any:
        """The (uninstantiated) CUgraph of one graph, built once (libember's builder, else Python)."""
        g = self._graphs.get(index)
        if g is None:
            with self._driver_lock:
                g = self._graphs.get(index)
                if g is None:
                    prep = self.prepared(index)
                    one, _ = rebuild.build_native(
                        [prep], self.ctx, self.events, instantiate=False, threads=1, splices=self._splices
                    )
                    g = one[0][0] if one[0] else rebuild.build(prep, self.ctx, self.events, self._splices)
                    self._graphs[index] = g
        return g

    def apply_function_attrs(self) -> None:
        t = time.perf_counter()
        rebuild.apply_function_attrs(self.functions, self.source.function_attrs)
        self.timings.function_attrs_ms = (time.perf_counter() - t) * 1e3

    def build_templates(self) -> None:
        """Prepare, build and instantiate one template per group (libember builds and
        instantiates them in one call, see build_native.build_native).

        Nothing else is started: any other key is prepared and built when it is first asked for
        (one graph: ~10-20 ms at 2,000 nodes). Preparing every graph on worker threads right away
        made the engine's first request wait: its foreground build took turns for the GIL with
        ~1 s of background preparation (benchmarks/results/cb-nvidia-h200.md: first token 0.89 s).
        `start_background()` builds the rest off the request path when an engine wants it.
        """
        self.apply_function_attrs()
        self._regroup()
        t = time.perf_counter()
        preps = [self.prepared(g.template) for g in self.groups]
        self.timings.prepare_ms += (time.perf_counter() - t) * 1e3
        # All templates in one libember call (one builder thread unless EMBER_BUILD_THREADS says
        # otherwise); any it leaves (child graphs, an edge strategy this driver needs) are built
        # by the Python path below.
        with self._driver_lock:
            built, nt = rebuild.build_native(
                preps, self.ctx, self.events, instantiate=True, splices=self._splices
            )
        self.timings.native_ms = nt["wall_ms"]
        self.timings.threads = int(nt["threads"])
        self.timings.build_ms += nt["build_cpu_ms"]
        self.timings.instantiate_ms += nt["instantiate_cpu_ms"]
        for group, pair in zip(self.groups, built, strict=True):
            i = group.template
            if pair is not None:
                self._graphs[i] = pair[0]
                self._templates[group.index] = _Exec(pair[1], i)
                continue
            t = time.perf_counter()
            g = self.graph(i)
            t0 = time.perf_counter()
            with self._driver_lock:
                handle = rebuild.instantiate(g)
            self.timings.build_ms += (t0 - t) * 1e3
            self.timings.instantiate_ms += (time.perf_counter() - t0) * 1e3
            self._templates[group.index] = _Exec(handle, i)
        self.timings.templates = len(self.groups)

    def _regroup(self) -> None:
        """Split topology groups by the shapes of this rank's collectives (see split_groups)."""
        if self.splicer is None:
            return
        t = time.perf_counter()
        self.groups = split_groups(self.groups, self._spliced, self.splicer.signature)
        self._group_of = {m: g.index for g in self.groups for m in g.members}
        self.timings.splice_ms = (time.perf_counter() - t) * 1e3

    def prebuild_all(self) -> None:
        """Build every graph's CUgraph now (SAVE's proof and benchmarks; LOAD does it lazily)."""
        for i in range(len(self.keys)):
            self.graph(i)

    def start_background(self, keys: Iterable[tuple[int, ...]] = ()) -> threading.Thread:
        """Build the remaining CUgraphs and dedicated execs for `keys` off the request path."""
        wanted = [self.key_index(k) for k in keys]

        def work() -> None:
            for i in range(len(self.keys)):
                self.graph(i)
            for i in wanted:
                self.dedicate(i)

        self._background = threading.Thread(target=work, name="ember-background", daemon=True)
        self._background.start()
        return self._background

    def wait_background(self) -> None:
        if self._background is not None:
            self._background.join()

    def dedicate(self, index: int) -> Any:
        """Instantiate a dedicated exec for one graph (hot keys)."""
        ex = self._dedicated.get(index)
        if ex is None:
            g = self.graph(index)
            with self._driver_lock:
                ex = self._dedicated.get(index)
                if ex is None:
                    ex = self._dedicated[index] = rebuild.instantiate(g)
        return ex

    def drop_dedicated(self, index: int) -> None:
        self._asked.discard(index)
        with self._driver_lock:
            ex = self._dedicated.pop(index, None)
            if ex is not None:
                cu.cuGraphExecDestroy(ex)

    # ---- launching ----------------------------------------------------------------------
    def restored(self, key: Iterable[int]) -> RestoredGraph:
        return RestoredGraph(self, self.key_index(key))

    def all_restored(self) -> dict[tuple[int, ...], RestoredGraph]:
        return {k: RestoredGraph(self, i) for i, k in enumerate(self.keys)}

    def exec_for(self, index: int) -> Any:
        """An exec that holds graph `index` now: dedicated, or the group template (updated if needed)."""
        ex = self._dedicated.get(index)
        if ex is not None:
            return ex
        tmpl = self._templates[self._group_of[index]]
        if tmpl.holds != index:
            self.switch(index)
        if tmpl.updated and self._hot_after and index not in self._asked:
            self._uses[index] += 1
            if self._uses[index] >= self._hot_after:
                self._asked.add(index)
                self._pending.append(self._pool.submit(self._dedicate_quietly, index))
        return tmpl.handle

    def switch(self, index: int) -> float:
        """Load graph `index` into its group's template exec; returns the update's milliseconds."""
        tmpl = self._templates[self._group_of[index]]
        g = self.graph(index)
        with self._driver_lock:
            t = time.perf_counter()
            err, info = cu.cuGraphExecUpdate(tmpl.handle, g)
            ms = (time.perf_counter() - t) * 1e3
            if err != OK:
                result = getattr(info, "result", info)
                raise CudaError(f"cuGraphExecUpdate(graph {self.keys[index]})", f"{err} ({result})")
            tmpl.holds, tmpl.updated = index, True
        self.switch_ms.append(ms)
        return ms

    def settle(self, timeout: float | None = None) -> int:
        """Wait for the dedicated execs asked for so far; returns how many are still pending."""
        pending, self._pending = self._pending, []
        _, left = wait(pending, timeout=timeout)
        self._pending.extend(left)
        return len(left)

    def _dedicate_quietly(self, index: int) -> None:
        """On a pool thread, which has no current context of its own: the library's."""
        with contextlib.suppress(CudaError):  # the template keeps serving this key
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            self.dedicate(index)

    def launch(self, index: int, stream: Any = None) -> None:
        ex = self.exec_for(index)
        r = cu.cuGraphLaunch(
            ex, torch_stream_handle(stream) if not isinstance(stream, cu.CUstream) else stream
        )
        if r[0] != OK:
            raise CudaError(f"cuGraphLaunch(graph {self.keys[index]})", r[0])

    def launch_template(self, index: int, stream: Any = None) -> None:
        """Launch through the group template (never the dedicated exec): SAVE's proof uses it."""
        tmpl = self._templates[self._group_of[index]]
        if tmpl.holds != index:
            self.switch(index)
        check(cu.cuGraphLaunch(tmpl.handle, torch_stream_handle(stream)), "cuGraphLaunch")

    # ---- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        self.wait_background()
        self._pool.shutdown(wait=True)
        with self._driver_lock:
            for ex in list(self._dedicated.values()):
                cu.cuGraphExecDestroy(ex)
            for t in self._templates.values():
                cu.cuGraphExecDestroy(t.handle)
            for g in self._graphs.values():
                cu.cuGraphDestroy(g)
            self.events.destroy()
            if self.splicer is not None:
                self.splicer.close()
            self._dedicated.clear()
            self._templates.clear()
            self._graphs.clear()
