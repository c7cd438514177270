"""Diagnose union members whose outputs differ through the union template (run in save mode).

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=save EMBER_ARM=manual \
        python3 benchmarks/results/diag/diag_union_members.py [sizes] [--out=FILE] [--memsets-optional]

Captures the eager Llama-3-8B shape at `sizes` (default: all 67), builds the union templates SAVE
would write, and launches every member through its union exec in key order, as SAVE's proof
does. For each member that differs from its captured graph it tells apart:
- the exec's enabled state after the switch against the member's mask (`cuGraphNodeGetEnabled`);
- a fresh exec of the union template switched straight to the member (does history matter?);
- a fresh exec of the member's union-shaped graph with the mask applied (is the graph itself
  wrong, or the exec update?);
- the member's optional slots: which of its kernels sit where another member's nodes are off;
- the union-shaped graph without its disabled memsets, or without its disabled kernels.

`--memsets-optional` lets unions leave memsets out of members, as SAVE once did. On
an H200 (driver 580.159) the three members lacking a 4-byte memset per layer then differed, with
the enabled state as asked; they passed once the disabled memset nodes were removed, and failed
with only the disabled kernels removed (benchmarks/results/union-members-h200-20261127.json). So
only kernel slots are optional now (ember.archive.union).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cuda.bindings import driver as cu
from diag_restore import captured_graph_set  # run from benchmarks/results/diag: its siblings import

from ember.archive import graph_table as fmt
from ember.archive import union
from ember.archive.graphs import NodeType
from ember.archive.union import union_groups
from ember.engines.decode.model import DecodeWorkload
from ember.runtime.graphs.driver import add_dependencies, check, graph_edges, graph_nodes
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.session import native_session


def stream() -> cu.CUstream:
    return cu.CUstream(torch.cuda.current_stream().cuda_stream)


class Runs:
    """Outputs of one key's launches from one saved state (outputs poisoned first)."""

    def __init__(self, w: DecodeWorkload) -> None:
        self.w, self.state = w, w.state_tensors()
        self.snap = [s.clone() for s in self.state]

    def __call__(self, key: tuple[int, ...], launch: Any) -> list[torch.Tensor]:
        for s, v in zip(self.state, self.snap, strict=True):
            s.copy_(v)
        for o in self.w.outs[key]:
            o.view(torch.uint8).fill_(0xA5)
        launch()
        torch.cuda.synchronize()
        return [o.clone() for o in self.w.outs[key]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def chain_nodes(graph: Any) -> list[int]:
    """A chain graph's nodes from its root along its edges."""
    frm, to, _ = graph_edges(graph)
    nxt = dict(zip(frm, to, strict=True))
    nodes = [int(n) for n in graph_nodes(graph)]
    node = next(n for n in nodes if n not in set(to))
    order = [node]
    while node in nxt:
        node = nxt[node]
        order.append(node)
    return order


def enabled_state(exec_handle: Any, nodes: np.ndarray) -> list[int]:
    return [int(check(cu.cuGraphNodeGetEnabled(exec_handle, cu.CUgraphNode(int(n))), "get enabled"))
            for n in nodes]


def member_report(lib: GraphLibrary, gs: Any, runs: Runs, i: int, ref: list[torch.Tensor]) -> dict[str, Any]:
    key = lib.keys[i]
    group = lib.groups[lib._group_of[i]]
    union = group.union
    tmpl = lib._templates[group.index]
    pos = union.position[i]
    slots = np.asarray(union.info.slots[pos], dtype=np.int64)
    want = np.zeros(union.info.nodes, dtype=np.uint8)
    want[slots] = 1
    got = np.asarray(enabled_state(tmpl.handle, union.nodes), dtype=np.uint8)
    row: dict[str, Any] = {"key": key, "position": pos, "members": len(union.members),
                           "nodes": len(slots), "union_nodes": int(union.info.nodes),
                           "enabled_wrong": np.flatnonzero(got != want).tolist()[:20]}
    # a fresh exec of the template, switched straight to this member
    ex = check(cu.cuGraphInstantiate(union.graph, 0), "instantiate template")
    err, _info = cu.cuGraphExecUpdate(ex, union.graph_of(lib, i))
    row["fresh_update"] = str(err)
    for n, on in zip(union.nodes.tolist(), want.tolist(), strict=True):
        check(cu.cuGraphNodeSetEnabled(ex, cu.CUgraphNode(n), on), "set enabled")
    row["fresh_template_ok"] = same(ref, runs(key, lambda: check(cu.cuGraphLaunch(ex, stream()), "launch")))
    cu.cuGraphExecDestroy(ex)
    # the member's union-shaped graph instantiated on its own, the mask applied
    g = union.graph_of(lib, i)
    ex = check(cu.cuGraphInstantiate(g, 0), "instantiate member graph")
    order = chain_nodes(g)
    for n, on in zip(order, want.tolist(), strict=True):
        check(cu.cuGraphNodeSetEnabled(ex, cu.CUgraphNode(n), on), "set enabled")
    launch = lambda: check(cu.cuGraphLaunch(ex, stream()), "launch")  # noqa: E731
    row["member_graph_masked_ok"] = same(ref, runs(key, launch))
    # no mask at all on an exec of the member's own graph: the rebuild itself
    cu.cuGraphExecDestroy(ex)
    lib.own.instantiate(i)
    row["own_exec_ok"] = same(ref, runs(key, lambda: lib.launch(i)))
    lib.own.drop(i)
    # the member's nodes in optional slots, and the other members' nodes around them
    optional = set(union.optional.tolist())
    g0 = gs.graphs[i]
    row["own_optional"] = [
        (int(s), j, kname(gs, g0.nodes[j])) for j, s in enumerate(slots.tolist()) if s in optional][:12]
    tg = lib.source.graph_of_row(union.info.row)  # type: ignore[attr-defined]
    off = np.flatnonzero(want == 0).tolist()
    row["off_types"] = {str(t): sum(int(tg.nodes[s].type) == t for s in off) for t in (0, 1, 2)}
    row["off_first"] = [(s, kname(gs, tg.nodes[s])) for s in off[:8]]
    for label, drop in (("drop_all_off", {0, 1, 2}), ("drop_off_memsets", {2}), ("drop_off_kernels", {0})):
        row[label] = dropped_ok(union.graph_of(lib, i), want, drop, lambda ex: runs(key, lambda: check(
            cu.cuGraphLaunch(ex, stream()), "launch")), ref)
    return row


def dropped_ok(graph: Any, want: np.ndarray, drop: set[int], run: Any, ref: list[torch.Tensor]) -> bool:
    """A clone of `graph` without its disabled nodes of the types in `drop` (the chain joined up
    again), the other disabled ones disabled: does it give the captured outputs?"""
    clone = check(cu.cuGraphClone(graph), "clone")
    kept: list[tuple[int, int]] = []
    for slot, node in enumerate(chain_nodes(clone)):
        kind = check(cu.cuGraphNodeGetType(cu.CUgraphNode(node)), "type")
        kind = int(getattr(kind, "value", kind))
        if not want[slot] and kind in drop:
            check(cu.cuGraphDestroyNode(cu.CUgraphNode(node)), "destroy node")
        else:
            kept.append((slot, node))
    frm, to, _ = graph_edges(clone)
    have = set(zip(frm, to, strict=True))
    for (_, a), (_, b) in itertools.pairwise(kept):
        if (a, b) not in have:
            add_dependencies(clone, [a], [b], None)
    ex = check(cu.cuGraphInstantiate(clone, 0), "instantiate clone")
    for slot, node in kept:
        if not want[slot]:
            check(cu.cuGraphNodeSetEnabled(ex, cu.CUgraphNode(node), 0), "set enabled")
    ok = same(ref, run(ex))
    cu.cuGraphExecDestroy(ex)
    cu.cuGraphDestroy(clone)
    return ok


def kname(gs: Any, node: Any) -> str:
    if node.type == NodeType.KERNEL:
        p = node.params
        name = gs.kernels[p.kernel].name[:70]
        return f"{name} grid={p.grid} block={p.block} smem={p.shared_mem} attrs={sorted(p.attrs)}"
    return f"{NodeType(node.type).name} {node.params}"[:120]


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--memsets-optional" in sys.argv:
        union.OPTIONAL_NODES = frozenset({NodeType.KERNEL, NodeType.MEMSET})
    out_path = next((Path(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--out=")), None)
    ip = native_session("save")
    assert ip is not None, "run under libember (save mode)"
    kw = {"sizes": tuple(int(s) for s in argv[0].split(","))} if argv else {}
    w = DecodeWorkload.from_name("llama3-8b", **kw)
    gs, orig = captured_graph_set(ip, w)
    ugs = union_groups(gs.graphs, gs.function_attrs)
    report: dict[str, Any] = {"unions": [
        {"members": [gs.graphs[m].key[0] for m in u.members], "nodes": len(u.graph.nodes),
         "member_nodes": [len(s) for s in u.slots], "optional": len(u.optional())} for u in ugs]}
    print(json.dumps(report), flush=True)
    lib = GraphLibrary(fmt.decode(fmt.encode(gs, unions=True)), orig, hot_after=0)
    lib.build_templates()
    runs = Runs(w)
    results, bad = {}, []
    for i, key in enumerate(lib.keys):
        ref = runs(key, w.graphs[key].replay)
        ok = same(ref, runs(key, lambda i=i: lib.launch_template(i)))
        results[key[0]] = ok
        if not ok and lib.groups[lib._group_of[i]].union is not None:
            row = member_report(lib, gs, runs, i, ref)
            bad.append(row)
            print(json.dumps(row, default=str)[:4000], flush=True)
    report["template_ok"] = results
    report["bad"] = bad
    # the failing members again, each right after a fresh template build and in reverse order
    print(json.dumps({"failing": [k for k, v in results.items() if not v]}), flush=True)
    if out_path:
        out_path.write_text(json.dumps(report, indent=1, default=str))
    lib.close()


if __name__ == "__main__":
    main()
