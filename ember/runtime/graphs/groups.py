"""What a GraphLibrary is made of besides its logic: where it reads graphs from (`GraphSource`),
its groups (a topology group, or a union template's members) and their execs, the events its
graphs record and wait on, and where the time to build them went (`LoadTimings`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cuda.bindings import driver as cu

from ember.archive.graphs import FunctionAttrs, Graph, GraphSet, KernelRef
from ember.archive.topology import group_graphs
from ember.runtime.graphs import rebuild


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


class Events:
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
class Group:
    """Graphs served by one template exec: a topology group (`template` is the member it is
    instantiated from) or a union template's members (`union`; `template` is -1)."""

    index: int
    members: list[int]
    template: int
    union: Any = None  # ember.runtime.graphs.unions.UnionTemplate

    def name(self, keys: Sequence[tuple[int, ...]]) -> str:
        return f"union of {len(self.members)} graphs" if self.union is not None else str(keys[self.template])


@dataclass
class TemplateExec:
    handle: Any
    holds: int  # graph index currently loaded into the exec (-1: none yet, a union template)
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
    upload_ms: float = 0.0  # cuGraphUpload of the templates, waits included (own execs: Dedicator.stats)
    upload_call_ms: float = 0.0  # of which in the cuGraphUpload calls
    per_graph: list[tuple[float, float]] = field(default_factory=list)  # (build, instantiate) ms


def initial_groups(source: Any, unions: Sequence[Any] = ()) -> list[Group]:
    """The source's union templates (`unions.UnionTemplate`s), then its topology groups without
    the graphs a union serves (a group keeps its template where it can)."""
    out = [Group(n, list(u.members), -1, u) for n, u in enumerate(unions)]
    taken = {m for u in unions for m in u.members}
    for g in source.groups:
        rest = [m for m in g.members if m not in taken]
        if rest:
            out.append(Group(len(out), rest, g.template if g.template in rest else rest[0]))
    return out


def unfolded(source: Any, union: Group, order: Sequence[int], first_index: int) -> list[Group]:
    """The topology groups of a union's members (indexed from `first_index`), each with its
    first needed member as template (`order`: need order)."""
    rank = {i: r for r, i in enumerate(order)}
    taken, out = set(union.members), list[Group]()
    for g in source.groups:
        members = sorted((m for m in g.members if m in taken), key=rank.__getitem__)
        if members:
            out.append(Group(first_index + len(out), members, members[0]))
    return out


def split_groups(
    groups: Sequence[Any], spliced: dict[int, list[tuple[int, int]]], shape: Any
) -> list[Group]:
    """Topology groups split so that members also agree on the shapes (`shape(i)`: node types of
    collective i's graph on this rank) of the collectives spliced into them: NCCL may pick another
    algorithm for another message size, and a template exec only takes graphs of its topology.
    A group keeps its template where it can."""
    out: list[Group] = []
    for g in groups:
        parts: dict[tuple[Any, ...], list[int]] = {}
        for m in g.members:
            parts.setdefault(tuple(shape(i) for _, i in spliced.get(m, [])), []).append(m)
        for members in parts.values():
            out.append(Group(len(out), members, g.template if g.template in members else members[0]))
    return out


