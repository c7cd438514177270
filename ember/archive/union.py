"""Union templates: one exec for chains of different topologies.

A topology group's template serves only graphs of its exact topology, and on an H100 the eager
Llama-3-8B shape's 67 decode sizes fall into 25 groups: per layer, one kernel's cluster dimension
or one extra node (a split-K reduction, a memset) differs. Instantiating 25 templates is most of
LOAD's driver time. A union template is one chain that holds every node of several chains: a
common supersequence of their node classes (`topology.node_class`: what exec update cannot
change). A member runs on it with its own parameters in its slots and every other slot disabled
(`cuGraphNodeSetEnabled`: a disabled kernel node is an empty node, and the chain keeps the order
of what is left).

Only chains qualify: every edge is (i, i + 1), and every node is a kernel, memset or memcpy node.
Anything else stays in its topology group. An edge with edge data (programmatic dependent launch,
as cuBLAS's GEMMs on Hopper use) qualifies only with EMBER_UNION_PROGRAMMATIC=1 until a GPU run
has proven it: the template keeps a programmatic edge only between slots every member has and
links the same way, and makes every other edge a default one (`_edges`). Kernel slots may be
optional: disabled for a member that lacks them. A disabled memset is not inert: the driver
documents it as an empty node, but on an H200 (driver 580.159) a disabled 4-byte memset still
wrote its destination, which in another member's graph is live memory (benchmarks/results/
diag/diag_union_members.py: the members it broke passed once those memset nodes were removed). So a
memset slot is optional only with EMBER_UNION_MEMSETS=1 (until a GPU run has proven it), and is
never disabled: a member that lacks it runs a placeholder there, the slot's memset with its
destination moved to a scratch buffer LOAD allocates (`placeable`: 1-D, at most
`PLACEHOLDER_BYTES`; exec update may change a 1-D memset's address, not its dimensions).
Otherwise memset and memcpy nodes are anchors that every member of a union has, in the same
order, and the merge aligns the other nodes between them. A
union grows only while it stays within `MAX_GROWTH` times its longest member: a union made of
very different chains would launch more disabled nodes than it saves instantiations.

Pure Python, no CUDA. SAVE computes the unions (`union_groups`), the graph table stores each
union template as a graph of its own plus every member's slot map, and LOAD instantiates the
template once (ember.runtime.graphs.templates).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember import settings
from ember.archive.graphs import Edge, FunctionAttrs, Graph, MemsetParams, Node, NodeType
from ember.archive.topology import node_class

MAX_GROWTH = 1.5  # a union's length over its longest member's, at most
MAX_EDITS = 4096  # insertions + deletions one merge may need (Myers' diff stops beyond)
_CHAIN_NODES = frozenset({NodeType.KERNEL, NodeType.MEMSET, NodeType.MEMCPY})
OPTIONAL_NODES = frozenset({NodeType.KERNEL})  # the types a member may lack by default (module doc)
PLACEHOLDER_BYTES = 1 << 20  # an optional memset writes at most this much (its placeholder's scratch)


@dataclass(frozen=True)
class UnionGroup:
    """Chains served by one union template.

    `slots[m][j]` is the union slot of node j of member `members[m]` (strictly increasing);
    `graph` is the template: each slot holds the node of the first member that has it."""

    index: int
    members: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    graph: Graph

    def optional(self) -> list[int]:
        """Slots some member lacks: those are enabled or disabled per member."""
        everyone = set(range(len(self.graph.nodes)))
        for s in self.slots:
            everyone &= set(s)
        return sorted(set(range(len(self.graph.nodes))) - everyone)


def programmatic_by_default() -> bool:
    """Whether chains with programmatic edges may join unions (EMBER_UNION_PROGRAMMATIC=1): off
    until a GPU run has proven such unions (module doc)."""
    return settings.on("EMBER_UNION_PROGRAMMATIC")


def memsets_by_default() -> bool:
    """Whether memset slots may be optional (EMBER_UNION_MEMSETS=1, module doc)."""
    return settings.on("EMBER_UNION_MEMSETS")


def placeable(node: Node) -> bool:
    """A memset whose placeholder (same shape, scratch destination) can stand in for it."""
    p = node.params
    return (node.type == NodeType.MEMSET and isinstance(p, MemsetParams) and p.height <= 1
            and p.width * p.element_size <= PLACEHOLDER_BYTES)


def not_a_chain(graph: Graph, programmatic: bool = False) -> str:
    """Why `graph` cannot join a union ("" when it can); `programmatic`: its edges i -> i + 1
    may carry edge data (programmatic dependent launch) too."""
    n = len(graph.nodes)
    if n == 0:
        return "no nodes"
    bad = [i for i, node in enumerate(graph.nodes) if node.type not in _CHAIN_NODES]
    if bad:
        return f"node {bad[0]} is a {NodeType(graph.nodes[bad[0]].type).name} node, which cannot be disabled"
    if len(graph.edges) != n - 1:
        return f"{len(graph.edges)} edges for {n} nodes: not a chain"
    for i, e in enumerate(graph.edges):
        if (e.src, e.dst) != (i, i + 1) or (not programmatic and (e.from_port or e.to_port or e.type)):
            data = f"ports {e.from_port}/{e.to_port}, type {e.type}"
            return f"edge {i} is {e.src}->{e.dst} ({data}): not a chain"
    return ""


def _lcs(a: Sequence[int], b: Sequence[int], max_edits: int) -> list[tuple[int, int]] | None:
    """Index pairs of a longest common subsequence of a and b (Myers' O((N+M)D) diff), or None
    when they differ by more than `max_edits` insertions and deletions."""
    n, m = len(a), len(b)
    top = min(n + m, max_edits)
    off = top + 1
    v = [0] * (2 * top + 3)
    trace: list[list[int]] = []
    for d in range(top + 1):
        trace.append(v[:])
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[off + k - 1] < v[off + k + 1]):
                x = v[off + k + 1]  # down: an element of b
            else:
                x = v[off + k - 1] + 1  # right: an element of a
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[off + k] = x
            if x >= n and y >= m:
                return _backtrack(trace, v, off, n, m, d)
    return None


def _backtrack(trace: list[list[int]], last: list[int], off: int, n: int, m: int, d: int
               ) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    x, y = n, m
    for dd in range(d, 0, -1):
        v = trace[dd]
        k = x - y
        down = k == -dd or (k != dd and v[off + k - 1] < v[off + k + 1])
        pk = k + 1 if down else k - 1
        px = v[off + pk]
        py = px - pk
        sx = px if down else px + 1  # where the snake of step dd began
        while x > sx:
            x, y = x - 1, y - 1
            pairs.append((x, y))
        x, y = px, py
    while x > 0 and y > 0:  # the snake of step 0
        x, y = x - 1, y - 1
        pairs.append((x, y))
    pairs.reverse()
    return pairs


def supersequence(
    a: Sequence[int], b: Sequence[int], max_edits: int = MAX_EDITS
) -> tuple[list[int], list[int], list[int]] | None:
    """A shortest common supersequence of a and b: (merged, where each a[i] went, where each b[j]
    went), both maps strictly increasing; None when they differ by more than `max_edits`."""
    pairs = _lcs(a, b, max_edits)
    if pairs is None:
        return None
    merged: list[int] = []
    amap: list[int] = []
    bmap: list[int] = []
    i = j = 0
    for x, y in [*pairs, (len(a), len(b))]:
        for t in a[i:x]:
            amap.append(len(merged))
            merged.append(t)
        for t in b[j:y]:
            bmap.append(len(merged))
            merged.append(t)
        if x < len(a):
            amap.append(len(merged))
            bmap.append(len(merged))
            merged.append(a[x])
        i, j = x + 1, y + 1
    return merged, amap, bmap


def anchored_supersequence(
    a: Sequence[int], b: Sequence[int], anchors: frozenset[int] | set[int], max_edits: int = MAX_EDITS
) -> tuple[list[int], list[int], list[int]] | None:
    """`supersequence` in which every element of `anchors` is common to a and b: None unless both
    hold the same anchors in the same order. The parts between anchors are merged one by one."""
    ia = [i for i, t in enumerate(a) if t in anchors]
    ib = [j for j, t in enumerate(b) if t in anchors]
    if [a[i] for i in ia] != [b[j] for j in ib]:
        return None
    merged: list[int] = []
    amap: list[int] = []
    bmap: list[int] = []
    pa = pb = 0
    for x, y in [*zip(ia, ib, strict=True), (len(a), len(b))]:
        found = supersequence(a[pa:x], b[pb:y], max_edits)
        if found is None:
            return None
        part, pmap, qmap = found
        max_edits -= 2 * len(part) - (x - pa) - (y - pb)  # the insertions and deletions it took
        amap += [len(merged) + s for s in pmap]
        bmap += [len(merged) + s for s in qmap]
        merged += part
        if x < len(a):  # the anchor itself: one slot for both
            amap.append(len(merged))
            bmap.append(len(merged))
            merged.append(a[x])
        pa, pb = x + 1, y + 1
    return merged, amap, bmap


@dataclass
class _Union:
    classes: list[int]
    owners: list[tuple[int, int]]  # per slot: (graph index, node index) whose node fills it
    members: dict[int, list[int]] = field(default_factory=dict)  # graph index -> its slots
    longest: int = 0

    def merge(self, g: int, seq: list[int], max_growth: float, anchors: set[int]) -> bool:
        longest = max(self.longest, len(seq))
        budget = int(2 * max_growth * longest) - len(self.classes) - len(seq)  # see module doc
        if budget < 0:
            return False
        found = anchored_supersequence(self.classes, seq, anchors, min(budget, MAX_EDITS))
        if found is None or len(found[0]) > max_growth * longest:
            return False
        merged, amap, bmap = found
        owners: list[tuple[int, int] | None] = [None] * len(merged)
        for s, owner in enumerate(self.owners):
            owners[amap[s]] = owner
        for j, s in enumerate(bmap):
            if owners[s] is None:
                owners[s] = (g, j)
        self.classes, self.owners, self.longest = merged, [o for o in owners if o is not None], longest
        self.members = {m: [amap[s] for s in slots] for m, slots in self.members.items()}
        self.members[g] = bmap
        return True


def union_groups(
    graphs: Sequence[Graph], function_attrs: Sequence[FunctionAttrs] = (), *,
    order: Sequence[int] | None = None, max_growth: float = MAX_GROWTH, programmatic: bool | None = None,
    optional: frozenset[NodeType] | None = None,
) -> list[UnionGroup]:
    """Unions of the chains among `graphs`, merged in `order` (default: input order; need order
    puts the first needed key's nodes first). A union with one topology only is left out: its
    topology group serves it already. Members keep input order. `programmatic` (default:
    `programmatic_by_default()`): chains with programmatic edges join too (`_edges`). `optional`:
    the node types a member may lack (default: kernels, and `placeable` memsets with
    `memsets_by_default()`)."""
    if programmatic is None:
        programmatic = programmatic_by_default()
    if optional is None:
        optional = OPTIONAL_NODES | ({NodeType.MEMSET} if memsets_by_default() else set())
    ids: dict[bytes, int] = {}
    chains = [g for g in (order if order is not None else range(len(graphs)))
              if not not_a_chain(graphs[g], programmatic)]
    seqs = {g: [ids.setdefault(node_class(nd, function_attrs), len(ids)) for nd in graphs[g].nodes]
            for g in chains}
    anchors = {c for g in chains for c, nd in zip(seqs[g], graphs[g].nodes, strict=True)  # in every member
               if nd.type not in optional or (nd.type == NodeType.MEMSET and not placeable(nd))}
    unions: list[_Union] = []
    seen: dict[tuple[int, ...], tuple[_Union, int]] = {}  # a topology met before: same slots
    for g in chains:
        seq = seqs[g]
        if (hit := seen.get(tuple(seq))) is not None:
            u, like = hit
            u.members[g] = list(u.members[like])
            continue
        for u in unions:
            if u.merge(g, seq, max_growth, anchors):
                break
        else:
            u = _Union(list(seq), [(g, j) for j in range(len(seq))], {g: list(range(len(seq)))}, len(seq))
            unions.append(u)
        seen[tuple(seq)] = (u, g)
    out: list[UnionGroup] = []
    for u in unions:
        topologies = {tuple(s) for s in u.members.values()}
        if len(topologies) < 2:
            continue
        members = sorted(u.members)
        nodes = [copy.deepcopy(graphs[g].nodes[j]) for g, j in u.owners]
        slots = tuple(tuple(u.members[m]) for m in members)
        template = Graph((), nodes, _edges(graphs, members, slots, len(nodes)))
        out.append(UnionGroup(len(out), tuple(members), slots, template))
    return out


def _edges(graphs: Sequence[Graph], members: list[int], slots: tuple[tuple[int, ...], ...], n: int
           ) -> list[Edge]:
    """The template's chain: edge s -> s + 1 keeps its edge data (a programmatic edge) only where
    every member has both slots and the same edge between them. Anywhere else it is a default
    edge: a member whose programmatic edge spans disabled slots waits for its predecessor to
    complete, which is stricter than its own graph (its kernel's early start is lost, its result
    is the same), and a disabled node is never an end of a programmatic edge."""
    common = set.intersection(*(set(run) for run in slots))
    data: list[set[Any] | None] = [set() if s in common and s + 1 in common else None for s in range(n - 1)]
    for m, run in zip(members, slots, strict=True):
        for j, e in enumerate(graphs[m].edges):  # both ends common: nothing between them, j -> j + 1
            if (d := data[run[j]]) is not None:
                d.add((e.from_port, e.to_port, e.type))
    return [Edge(s, s + 1, *next(iter(d))) if d is not None and len(d) == 1 else Edge(s, s + 1)
            for s, d in enumerate(data)]
