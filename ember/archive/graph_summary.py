"""The manifest's summary of a graph table (`graphs`): written from the table SAVE encoded, and
compared with the table again by `ember verify`."""

from __future__ import annotations

from ember.archive import graph_table
from ember.archive.graphs import GraphSet, KernelParams, MemcpyParams, MemsetParams
from ember.archive.manifest import GraphsSummary, Manifest, TopologyGroupSummary, UnionSummary
from ember.archive.topology import TopologyGroup


def summarize(gs: GraphSet, groups: list[TopologyGroup], table: graph_table.GraphTable,
              table_blob: str = "graphs") -> GraphsSummary:
    """The summary of `gs`, encoded as `table` (its blob named `table_blob`)."""
    keys = [list(g.key) for g in gs.graphs]
    return GraphsSummary(
        table=table_blob,
        table_version=graph_table.VERSION,
        count=len(gs.graphs),
        keys=keys,
        nodes=table.node_total,
        node_types=table.node_type_counts(),
        kernels=len(gs.kernels),
        groups=[
            TopologyGroupSummary(
                signature=g.signature,
                keys=[keys[m] for m in g.members],
                template=keys[g.template],
                nodes=len(gs.graphs[g.template].nodes),
                edges=len(gs.graphs[g.template].edges),
            )
            for g in groups
        ],
        unions=[UnionSummary(keys=[keys[m] for m in u.members], nodes=u.nodes, optional=len(u.optional))
                for u in table.unions],
    )


def differences(m: Manifest, table: graph_table.GraphTable) -> list[str]:
    """Where the table and the manifest's summary of it disagree (ember verify)."""
    problems = []
    if [list(k) for k in table.keys] != m.graphs.keys:
        problems.append("graph keys in the graph table differ from the manifest's")
    sigs = [g.signature for g in table.groups]
    if sigs != [g.signature for g in m.graphs.groups]:
        problems.append("topology groups in the graph table differ from the manifest's")
    unions = [([list(table.keys[i]) for i in u.members], u.nodes) for u in table.unions]
    if unions != [(u.keys, u.nodes) for u in m.graphs.unions]:
        problems.append("union templates in the graph table differ from the manifest's")
    have = {i.content_hash for i in m.kernel_images}
    lost = sorted({k.image for k in table.kernels} - have)
    if lost:
        problems.append(f"{len(lost)} kernel image(s) the graphs use are not in the archive, e.g. {lost[0]}")
    if table.node_type_counts() != m.graphs.node_types:
        problems.append("node-type counts in the graph table differ from the manifest's")
    return problems


def graph_nodes(graph_set: GraphSet, key: tuple[int, ...], limit: int = 40) -> list[str]:
    """A graph's nodes in words (kernel name and grid, memset/memcpy bytes): what a SAVE that
    replays one graph for seconds logs about it."""
    graph = next((g for g in graph_set.graphs if tuple(g.key) == tuple(key)), None)
    out: list[str] = []
    for node in graph.nodes[:limit] if graph is not None else []:
        p = node.params
        if isinstance(p, KernelParams):
            out.append(f"{graph_set.kernels[p.kernel].name[:80]} grid={p.grid} block={p.block}")
        elif isinstance(p, MemsetParams):
            out.append(f"memset {p.width * p.height * p.element_size} B")
        elif isinstance(p, MemcpyParams):
            out.append(f"memcpy {p.size} B")
        else:
            out.append(node.type.name)
    return out
