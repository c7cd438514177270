"""Topology signatures: which graphs can share one instantiated template.

LOAD instantiates one template per group and switches between the group's graphs with
`cuGraphExecUpdate`. That update fails (or, worse, silently keeps stale state) unless the graphs
agree on everything it cannot change (docs/archive-format.md §5 has the byte-level signature):

- the node count, node types and their order;
- every edge, in order, WITH its edge data (from/to port, dependency type: programmatic edges);
- per kernel node: its launch attributes (cluster dimension, cooperative, scheduling policy,
  priority, mem-sync domain, device-updatable, ...): an exec cannot take new attributes, so ALL
  attribute ids and values are part of the key. For the cluster dimension this is measured:
  `cuGraphExecUpdate` to a node with another cluster dimension SUCCEEDS and the exec keeps
  launching with the old one (benchmarks/results/diag/diag_cluster_update.py,
  benchmarks/results/diag-cluster-update-H100-20261125.json), so those splits cannot be merged;
- per kernel node: the function-level cluster requirements (required / non-portable cluster
  size), since a function swap may not change them;
- per memset node: the element size and whether it is 1-D or 2-D;
- child graphs, recursively (their whole signature).

What may differ inside a group: grid, block, shared memory, argument bytes, the kernel function
(same context), memset/memcpy addresses, sizes and values, event identities.

Used by SAVE (grouping before writing the graph table), by the format (group index per graph)
and by LOAD (template choice). Pure Python, no CUDA.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ember.archive.graphs import FunctionAttrs, Graph, KernelParams, MemsetParams, Node, NodeType

SIGNATURE_VERSION = 1
_NO_FATTR = FunctionAttrs()


@dataclass(frozen=True)
class TopologyGroup:
    """Graphs (indices into the list grouped) that share one exec template."""

    index: int
    signature: str  # hex sha256
    members: tuple[int, ...]  # in input order; members[0] is the template

    @property
    def template(self) -> int:
        return self.members[0]


def node_items(
    node: Node, fattrs: Sequence[FunctionAttrs], at: str
) -> Iterator[tuple[str, bytes]]:
    """What one node (not a child graph) adds to the signature: everything exec update cannot
    change about it. Two nodes with equal items can take each other's parameters."""
    yield f"{at} type {node.type.name}", struct.pack("<B", int(node.type))
    p = node.params
    if node.type == NodeType.KERNEL and isinstance(p, KernelParams):
        fa = fattrs[p.kernel] if 0 <= p.kernel < len(fattrs) else _NO_FATTR
        yield (
            f"{at} function cluster requirement {fa.required_cluster}/{fa.non_portable_cluster}",
            struct.pack("<3Ii", *fa.required_cluster, fa.non_portable_cluster),
        )
        yield f"{at} attribute count {len(p.attrs)}", struct.pack("<I", len(p.attrs))
        for attr_id in sorted(p.attrs):
            value = p.attrs[attr_id]
            yield (
                f"{at} attribute {attr_id} = {value.rstrip(bytes(1)).hex() or '0'}",
                struct.pack("<II", attr_id, len(value)) + value,
            )
    elif node.type == NodeType.MEMSET and isinstance(p, MemsetParams):
        yield (
            f"{at} memset element size {p.element_size}, {'2-D' if p.height > 1 else '1-D'}",
            struct.pack("<IB", p.element_size, 1 if p.height > 1 else 0),
        )


def node_class(node: Node, fattrs: Sequence[FunctionAttrs] = ()) -> bytes:
    """The node's signature bytes: nodes of one class may share a slot of one exec."""
    return b"".join(piece for _, piece in node_items(node, fattrs, ""))


def _items(
    graph: Graph, fattrs: Sequence[FunctionAttrs], depth: int, where: str = ""
) -> Iterator[tuple[str, bytes]]:
    """What the signature hashes, in order, each piece with a description of what it is."""
    if depth > 16:
        raise ValueError(f"graph {graph.key}: child graphs nested deeper than 16 levels")
    yield f"{where}node/edge counts {len(graph.nodes)}/{len(graph.edges)}", struct.pack(
        "<BII", 0xA0, len(graph.nodes), len(graph.edges)
    )
    for i, node in enumerate(graph.nodes):
        at = f"{where}node {i}"
        yield from node_items(node, fattrs, at)
        if node.type == NodeType.GRAPH and isinstance(node.params, Graph):
            yield from _items(node.params, fattrs, depth + 1, f"{at} child: ")
    for j, e in enumerate(graph.edges):
        yield (
            f"{where}edge {j} {e.src}->{e.dst} ports {e.from_port}/{e.to_port} type {e.type}",
            struct.pack("<IIBBB", e.src, e.dst, e.from_port, e.to_port, e.type),
        )


def signature(graph: Graph, function_attrs: Sequence[FunctionAttrs] = ()) -> str:
    """Hex sha256 over everything exec update cannot change (see module docstring).

    `function_attrs` is `GraphSet.function_attrs` (indexed by KernelParams.kernel); when empty,
    function-level cluster requirements count as unset.
    """
    h = hashlib.sha256(struct.pack("<4sI", b"EMTS", SIGNATURE_VERSION))
    try:
        for _, piece in _items(graph, function_attrs, 0):
            h.update(piece)
    except (struct.error, TypeError) as exc:
        raise ValueError(f"graph {graph.key}: a field does not fit the signature encoding: {exc}") from exc
    return h.hexdigest()


def why_apart(a: Graph, b: Graph, function_attrs: Sequence[FunctionAttrs] = ()) -> str:
    """The first thing that keeps two graphs out of one topology group ("" when they share one):
    what to look at when there are more groups than expected."""
    for (da, pa), (db, pb) in zip(
        _items(a, function_attrs, 0), _items(b, function_attrs, 0), strict=False
    ):
        if pa != pb:
            return f"{a.key}: {da}; {b.key}: {db}"
    return ""


def group_graphs(
    graphs: Sequence[Graph], function_attrs: Sequence[FunctionAttrs] = ()
) -> list[TopologyGroup]:
    """Group graphs by signature. Groups are ordered by their first member's position, members
    keep input order, so the result is stable for a given input order."""
    by_sig: dict[str, list[int]] = {}
    for i, g in enumerate(graphs):
        by_sig.setdefault(signature(g, function_attrs), []).append(i)
    return [TopologyGroup(n, sig, tuple(m)) for n, (sig, m) in enumerate(by_sig.items())]


def group_index(groups: Sequence[TopologyGroup], count: int) -> list[int]:
    """Per graph (0..count-1), the index of its group."""
    out = [-1] * count
    for g in groups:
        for m in g.members:
            out[m] = g.index
    if -1 in out:
        raise ValueError(f"graph {out.index(-1)} is in no topology group")
    return out
