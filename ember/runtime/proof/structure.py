"""A rebuilt graph, walked back from the driver, against the captured one (torch-free, CPU-tested).

What must agree, node by node and recursively into child graphs:
- node types; kernel launch parameters (grid, block, shared memory, argument bytes and layout,
  `extra` blobs, node attributes);
- the kernel itself by its IDENTITY (`KernelRef`: content hash of its image + mangled name), so a
  same-named kernel from another image is a difference, and the function's attributes (dynamic
  shared memory, cluster requirements, carveout) as the driver reports them for the rebuilt
  node's function;
- memset / memcpy parameters; event nodes by the pattern they form (LOAD creates fresh events:
  the captured and rebuilt event indices must map one to one within the graph);
- edges with their edge data (`measures.edge_problems`).

`external_waits` finds event-wait nodes whose event no node of the same graph (child graphs
included) records: such a wait orders the graph after work outside it, and a restored graph
waits on a fresh event no one records, so the ordering would silently vanish. SAVE's walk
refuses those graphs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from ember.archive.graphs import EventParams, FunctionAttrs, Graph, KernelParams, KernelRef, NodeType
from ember.runtime.proof.measures import edge_problems

KERNEL_FIELDS = ("grid", "block", "shared_mem", "args", "arg_offsets", "arg_sizes", "extra", "attrs")
LIMIT = 6  # problems reported per graph (the first ones say enough)


def _ref_text(ref: KernelRef) -> str:
    return f"{ref.name[:60]} (image {ref.image[:12]})"


def _kernel_problems(
    where: str,
    pa: KernelParams,
    pb: KernelParams,
    refs: tuple[Sequence[KernelRef], Sequence[KernelRef]],
    attrs: tuple[Sequence[FunctionAttrs], Sequence[FunctionAttrs]],
) -> list[str]:
    out: list[str] = []
    ca, cb = refs[0][pa.kernel], refs[1][pb.kernel]
    for f in KERNEL_FIELDS:
        if getattr(pa, f) != getattr(pb, f):
            out.append(f"{where}: {f} differs ({ca.name[:60]})")
    if ca != cb:
        out.append(f"{where}: kernel {_ref_text(cb)}, captured {_ref_text(ca)}")
    if attrs[0] and attrs[1] and not same_function_attrs(attrs[0][pa.kernel], attrs[1][pb.kernel]):
        rebuilt, captured = attrs[1][pb.kernel], attrs[0][pa.kernel]
        out.append(f"{where}: function attributes {rebuilt}, captured {captured} ({ca.name[:60]})")
    return out


def same_function_attrs(a: FunctionAttrs, b: FunctionAttrs) -> bool:
    """Equal, a carveout the driver would not report (-1) on either side counting as unknown."""
    if -1 in (a.carveout, b.carveout):
        a, b = dataclasses.replace(a, carveout=-1), dataclasses.replace(b, carveout=-1)
    return a == b


def structure_problems(
    captured: Graph,
    rebuilt: Graph,
    cap_refs: Sequence[KernelRef],
    reb_refs: Sequence[KernelRef],
    cap_attrs: Sequence[FunctionAttrs] = (),
    reb_attrs: Sequence[FunctionAttrs] = (),
    *,
    _where: str = "",
    _events: dict[int, int] | None = None,
) -> list[str]:
    """What differs between a captured graph and the walk of its rebuild (empty = identical).

    Edges compare as a multiset (the driver may list them in another order); everything else
    node by node, child graphs recursively. Function attributes compare when both lists are
    given (indexed like the refs)."""
    top = _events is None
    events: dict[int, int] = {} if _events is None else _events  # captured index -> rebuilt index
    if len(captured.nodes) != len(rebuilt.nodes):
        return [f"{_where}{len(rebuilt.nodes)} nodes rebuilt, {len(captured.nodes)} captured"]
    out: list[str] = []
    refs, attrs = (cap_refs, reb_refs), (cap_attrs, reb_attrs)
    for i, (a, b) in enumerate(zip(captured.nodes, rebuilt.nodes, strict=True)):
        where = f"{_where}node {i}"
        if a.type != b.type:
            out.append(f"{where}: type {b.type.name}, captured {a.type.name}")
        elif a.type == NodeType.KERNEL:
            assert isinstance(a.params, KernelParams) and isinstance(b.params, KernelParams)
            out.extend(_kernel_problems(where, a.params, b.params, refs, attrs))
        elif a.type == NodeType.GRAPH:
            assert isinstance(a.params, Graph) and isinstance(b.params, Graph)
            out.extend(
                structure_problems(
                    a.params, b.params, cap_refs, reb_refs, cap_attrs, reb_attrs,
                    _where=f"{where} (child) ", _events=events,
                )
            )
        elif a.type in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            assert isinstance(a.params, EventParams) and isinstance(b.params, EventParams)
            if events.setdefault(a.params.event, b.params.event) != b.params.event:
                out.append(f"{where}: another event than the captured node's pattern")
        elif a.params != b.params:
            out.append(f"{where}: params differ")
        if len(out) >= LIMIT:
            return out[:LIMIT]
    if top and len(set(events.values())) != len(events):
        out.append(f"{_where}events: two captured events rebuilt as one")
    out.extend(f"{_where}{p}" for p in edge_problems(captured.edges, rebuilt.edges))
    return out[:LIMIT]


def _event_nodes(graph: Graph, where: str = "") -> Iterator[tuple[str, NodeType, int]]:
    for i, n in enumerate(graph.nodes):
        if n.type in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            assert isinstance(n.params, EventParams)
            yield f"{where}node {i}", n.type, n.params.event
        elif n.type == NodeType.GRAPH and isinstance(n.params, Graph):
            yield from _event_nodes(n.params, f"{where}node {i} (child) ")


def external_waits(graph: Graph) -> list[tuple[str, int]]:
    """(node path, event index) of every wait on an event no node of this graph (or its child
    graphs) records: ordering on work outside the graph, which a restore cannot keep."""
    nodes = list(_event_nodes(graph))
    recorded = {ev for _, t, ev in nodes if t == NodeType.EVENT_RECORD}
    return [(where, ev) for where, t, ev in nodes if t == NodeType.WAIT_EVENT and ev not in recorded]
