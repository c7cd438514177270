"""Topology signatures: graphs that exec update can switch between group together, others not."""

from __future__ import annotations

import copy
import struct

from ember.archive.graphs import (
    Edge,
    EventParams,
    FunctionAttrs,
    Graph,
    KernelParams,
    MemcpyParams,
    MemsetParams,
    Node,
    NodeType,
)
from ember.archive.topology import group_graphs, group_index, signature, why_apart

CLUSTER = 4
COOPERATIVE = 2
DEVICE_UPDATABLE = 13


def kernel(k: int = 0, grid: int = 1, args: bytes = b"\0" * 8, attrs: dict[int, bytes] | None = None) -> Node:
    return Node(NodeType.KERNEL, KernelParams(k, (grid, 1, 1), (128, 1, 1), 0, args=args, arg_offsets=(0,),
                                              arg_sizes=(len(args),), attrs=attrs or {}))


def graph(key: int, grid: int = 1, args: bytes = b"\0" * 8, **over: object) -> Graph:
    child_memset = Node(NodeType.MEMSET, MemsetParams(0x1000 * key, 0, key, 4, 64 * key, 1))
    child = Graph((), [kernel(1, grid), child_memset], [Edge(0, 1)])
    nodes = [
        Node(NodeType.MEMSET, MemsetParams(0x10 * key, 0, 0, 4, 128 * key, 1)),
        kernel(0, grid, args),
        kernel(2, grid * 2, args[::-1]),
        Node(NodeType.MEMCPY, MemcpyParams(0x100 * key, 0x200, 8 * key)),
        Node(NodeType.EVENT_RECORD, EventParams(key)),
        Node(NodeType.GRAPH, child),
        Node(NodeType.EMPTY),
    ]
    edges = [Edge(0, 1), Edge(1, 2, 0, 0, 1), Edge(2, 3), Edge(3, 4), Edge(4, 5), Edge(5, 6)]
    g = Graph((key,), nodes, edges)
    for name, value in over.items():
        setattr(g, name, value)
    return g


FATTRS = [FunctionAttrs(), FunctionAttrs(), FunctionAttrs(), FunctionAttrs(required_cluster=(2, 1, 1))]


def test_graphs_differing_only_in_launch_params_and_addresses_share_a_group() -> None:
    a = graph(1, grid=1, args=struct.pack("<Q", 0xAAAA))
    b = graph(8, grid=8, args=struct.pack("<Q", 0xBBBB))
    b.nodes[1].params.shared_mem = 4096  # type: ignore[union-attr]
    b.nodes[1].params.kernel = 1  # another function in the same context: updatable
    assert signature(a, FATTRS) == signature(b, FATTRS)
    groups = group_graphs([a, b], FATTRS)
    assert [g.members for g in groups] == [(0, 1)]
    assert groups[0].template == 0


def test_edge_type_and_ports_split_groups() -> None:
    base = graph(1)
    typed = graph(2)
    typed.edges[0] = Edge(0, 1, 0, 0, 1)  # programmatic instead of default
    ported = graph(3)
    ported.edges[1] = Edge(1, 2, 1, 0, 1)
    reordered = graph(4)
    reordered.edges[0], reordered.edges[1] = reordered.edges[1], reordered.edges[0]
    sigs = {signature(g, FATTRS) for g in (base, typed, ported, reordered)}
    assert len(sigs) == 4


def test_node_count_and_type_order_split_groups() -> None:
    base = graph(1)
    longer = graph(2)
    longer.nodes.append(Node(NodeType.EMPTY))
    swapped = graph(3)
    swapped.nodes[3], swapped.nodes[4] = swapped.nodes[4], swapped.nodes[3]
    assert len({signature(g) for g in (base, longer, swapped)}) == 3


def test_kernel_attributes_that_update_cannot_change_split_groups() -> None:
    def with_attr(key: int, attr: int, value: bytes) -> Graph:
        g = graph(key)
        g.nodes[2].params.attrs = {attr: value.ljust(64, b"\0")}  # type: ignore[union-attr]
        return g

    base = graph(1)
    c211 = with_attr(2, CLUSTER, struct.pack("<3I", 2, 1, 1))
    c211b = with_attr(3, CLUSTER, struct.pack("<3I", 2, 1, 1))
    c411 = with_attr(4, CLUSTER, struct.pack("<3I", 4, 1, 1))
    coop = with_attr(5, COOPERATIVE, struct.pack("<i", 1))
    devupd = with_attr(6, DEVICE_UPDATABLE, struct.pack("<i", 1))
    groups = group_graphs([base, c211, c211b, c411, coop, devupd])
    assert [g.members for g in groups] == [(0,), (1, 2), (3,), (4,), (5,)]


def test_why_apart_names_the_first_difference_and_nothing_inside_a_group() -> None:
    def with_cluster(key: int, x: int) -> Graph:
        g = graph(key)
        g.nodes[2].params.attrs = {CLUSTER: struct.pack("<3I", x, 1, 1).ljust(64, b"\0")}  # type: ignore[union-attr]
        return g

    a, b, c = with_cluster(1, 2), with_cluster(2, 2), with_cluster(3, 4)
    assert why_apart(a, b) == ""
    assert why_apart(a, c) == (
        f"(1,): node 2 attribute {CLUSTER} = 020000000100000001; "
        f"(3,): node 2 attribute {CLUSTER} = 040000000100000001"
    )
    longer = graph(4)
    longer.edges.append(Edge(0, 2))
    assert why_apart(a, longer).startswith("(1,): node/edge counts")


def test_signature_bytes_are_stable() -> None:
    """Archives store group signatures: the encoding must not drift (bump SIGNATURE_VERSION)."""
    from ember_testing.synthetic import synthetic_graphset

    gs = synthetic_graphset(graphs=12, nodes=300, groups=4, child_graphs=False)
    assert signature(gs.graphs[0], gs.function_attrs) == (
        "c21c2ee6f48c9b8560b59a73d6ab76dc866a9a11ff9e2d3b45675d650b6eac90"
    )


def test_function_cluster_requirements_split_groups() -> None:
    a = graph(1)
    b = graph(2)
    b.nodes[1].params.kernel = 3  # type: ignore[union-attr]  # a function with a required cluster
    assert signature(a, FATTRS) != signature(b, FATTRS)
    assert signature(a) == signature(b)  # without function attrs only node facts count


def test_memset_element_size_and_dimensionality_split_groups() -> None:
    base = graph(1)
    wide = graph(2)
    wide.nodes[0] = Node(NodeType.MEMSET, MemsetParams(0, 0, 0, 2, 128, 1))
    two_d = graph(3)
    two_d.nodes[0] = Node(NodeType.MEMSET, MemsetParams(0, 256, 0, 4, 128, 4))
    taller = graph(4)
    taller.nodes[0] = Node(NodeType.MEMSET, MemsetParams(0, 256, 0, 4, 128, 8))
    groups = group_graphs([base, wide, two_d, taller])
    assert [g.members for g in groups] == [(0,), (1,), (2, 3)]


def test_child_graph_topology_is_part_of_the_signature() -> None:
    base = graph(1)
    other = graph(2)
    child = copy.deepcopy(other.nodes[5].params)
    assert isinstance(child, Graph)
    child.edges[0] = Edge(0, 1, 0, 0, 1)
    other.nodes[5] = Node(NodeType.GRAPH, child)
    same = graph(3, grid=7)
    assert signature(base) != signature(other)
    assert signature(base) == signature(same)


def test_grouping_is_stable_and_ordered_by_first_member() -> None:
    gs = [graph(1), graph(2, nodes=[*graph(2).nodes, Node(NodeType.EMPTY)]), graph(3), graph(4)]
    gs[1].edges = [*gs[1].edges, Edge(6, 7)]
    groups = group_graphs(gs)
    assert [g.members for g in groups] == [(0, 2, 3), (1,)]
    assert [g.index for g in groups] == [0, 1]
    assert group_graphs(gs) == groups
    assert group_index(groups, 4) == [0, 1, 0, 0]


def test_signature_is_deterministic_across_copies() -> None:
    g = graph(5)
    assert signature(g, FATTRS) == signature(copy.deepcopy(g), FATTRS)
    assert len(signature(g)) == 64
