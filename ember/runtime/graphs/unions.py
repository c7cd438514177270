"""LOAD's side of union templates (ember.archive.union): one exec for chains of several topologies.

The template is instantiated once from the table's union row (every slot filled by its first
member). A member is switched in by `cuGraphExecUpdate` to the union-shaped graph of that member
(`prepare_table.in_union`: its nodes in its slots, the template's in the others), then every kernel
slot it lacks is disabled and every one it has enabled (libember's `ember_exec_enable`: all of
them, every switch, so no enabled state left from an earlier member or reset by the update
counts). A memset slot it lacks is never disabled (a disabled memset still wrote on an H200): the
update gives it a placeholder that writes the union's scratch buffer, allocated once per union
through the driver like the engine's own memory (exec update keeps a memset's kind of allocation).
Until the first switch the exec holds no member: `holds` is -1 and a launch switches first.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ember.runtime.graphs import rebuild
from ember.runtime.graphs.build_native import _interposer
from ember.runtime.graphs.driver import check
from ember.runtime.graphs.prepare_table import in_union, prepare_from_table
from ember.runtime.graphs.prepared import PreparedGraph


class UnionTemplate:
    """One union of the table (`UnionInfo`): its prepared template, its node handles once built,
    each member's enable mask and union-shaped CUgraph."""

    def __init__(self, info: Any) -> None:
        self.info = info
        self.position = {m: p for p, m in enumerate(info.members)}
        # the slots enabled per member: the optional kernels (placeholder memsets stay enabled)
        self.optional = np.setdiff1d(info.optional, info.placeholders).astype(np.int64)
        self.scratch = 0  # device buffer the placeholders write (cuMemAlloc), at the first member's switch
        self.nodes = np.zeros(info.nodes, dtype=np.uint64)  # the template's CUgraphNodes (builder)
        self.graph: Any = None  # the template's CUgraph, once built
        self.graphs: dict[int, Any] = {}  # member (graph index) -> its union-shaped CUgraph
        self._prep: PreparedGraph | None = None
        self._masks: dict[int, np.ndarray] = {}
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(self.info.members)

    def check_member(self, table: Any, index: int) -> None:
        """Graph `index` against its slots, once (FormatError: it must not be switched in). Checked
        at its first switch, not before the template: that would decode every member's chunk on
        the way to the template (66 ms for 67 Llama-sized chains on a 2-core VM)."""
        if index not in self._checked:
            table.check_union_member(self.info, self.position[index])
            self._checked.add(index)

    def prepared(self, table: Any, functions: Any, ctx: Any, attr_sets: Any) -> PreparedGraph:
        with self._lock:
            if self._prep is None:
                self._prep = prepare_from_table(table, 0, functions, ctx, attr_sets, row=self.info.row)
            return self._prep

    def member_prepared(self, index: int, member: PreparedGraph) -> PreparedGraph:
        """Graph `index` (prepared on its own) in the template's shape."""
        if self._prep is None:
            raise RuntimeError("the union template is not prepared yet")
        if self.info.scratch_bytes and not self.scratch:  # some member lacks a memset (it is optional)
            self.scratch = int(check(cu.cuMemAlloc(self.info.scratch_bytes), "cuMemAlloc (union scratch)"))
        return in_union(self._prep, member, self.info.slots[self.position[index]], self.info.placeholders,
                        self.scratch)

    def graph_of(self, lib: Any, index: int) -> Any:
        """Graph `index` in the template's shape, built once and kept (`lib`: the GraphLibrary)."""
        g = self.graphs.get(index)
        if g is None:
            with lib.driver_lock:
                g = self.graphs.get(index)
                if g is None:
                    prep = self.member_prepared(index, lib.prepared(index))
                    one, _ = rebuild.build_native([prep], lib.ctx, lib.events, instantiate=False, threads=1)
                    g = self.graphs[index] = one[0][0] if one[0] else rebuild.build(prep, lib.ctx, lib.events)
        return g

    def mask(self, index: int) -> np.ndarray:
        """Over the optional slots: 1 where graph `index` has a node, 0 where it is disabled."""
        found = self._masks.get(index)
        if found is None:
            slots = self.info.slots[self.position[index]]
            found = self._masks[index] = np.isin(self.optional, slots).astype(np.uint8)
        return found

    def enable(self, exec_handle: Any, index: int) -> None:
        """The exec's optional slots set for graph `index` (after its exec update)."""
        nodes, on = np.ascontiguousarray(self.nodes[self.optional]), self.mask(index)
        ip = _interposer()
        if ip is not None:
            ip.exec_enable(int(exec_handle), nodes, on)
            return
        for node, flag in zip(nodes.tolist(), on.tolist(), strict=True):  # no libember here
            check(cu.cuGraphNodeSetEnabled(exec_handle, cu.CUgraphNode(node), flag), "cuGraphNodeSetEnabled")

    def destroy(self) -> None:
        for g in [*self.graphs.values(), *([self.graph] if self.graph is not None else [])]:
            cu.cuGraphDestroy(g)
        self.graphs.clear()
        self.graph = None
        if self.scratch:
            cu.cuMemFree(self.scratch)
            self.scratch = 0
