"""CPU: the proof's structure comparison (kernels by image + name, function attributes, child
graphs, event pattern) and the external-wait rule SAVE's walk applies."""

from __future__ import annotations

import dataclasses

from ember.archive.graphs import (
    Edge,
    EventParams,
    FunctionAttrs,
    Graph,
    KernelParams,
    KernelRef,
    MemsetParams,
    Node,
    NodeType,
)
from ember.runtime.proof.structure import external_waits, structure_problems

REFS = [KernelRef("a" * 64, "rmsnorm"), KernelRef("b" * 64, "gemm")]
ATTRS = [FunctionAttrs(), FunctionAttrs(max_dynamic_shared=98304, carveout=100)]


def _k(kernel: int, grid: int = 1) -> Node:
    params = KernelParams(kernel=kernel, grid=(grid, 1, 1), block=(128, 1, 1), shared_mem=0)
    return Node(NodeType.KERNEL, params)


def _ev(t: NodeType, ev: int) -> Node:
    return Node(t, EventParams(ev))


def _events(a: int, b: int, c: int) -> Graph:
    """record a, kernel, wait b, record c"""
    rec, wait = NodeType.EVENT_RECORD, NodeType.WAIT_EVENT
    return _graph(_ev(rec, a), _k(0), _ev(wait, b), _ev(rec, c))


def _graph(*nodes: Node, key: tuple[int, ...] = (1,)) -> Graph:
    return Graph(key, list(nodes), [Edge(i, i + 1) for i in range(len(nodes) - 1)])


def _check(cap: Graph, reb: Graph, reb_refs=REFS, reb_attrs=ATTRS) -> list[str]:
    return structure_problems(cap, reb, REFS, reb_refs, ATTRS, reb_attrs)


def test_identical_graphs_have_no_problems_and_the_kernel_table_order_does_not_matter() -> None:
    g = _graph(_k(0), _k(1, grid=8), Node(NodeType.MEMSET, MemsetParams(4096, 0, 0, 4, 16, 1)))
    assert _check(g, g) == []
    # the rebuilt walk numbers its kernels itself: the same refs in another order are the same kernels
    swapped = _graph(_k(1), _k(0, grid=8), Node(NodeType.MEMSET, MemsetParams(4096, 0, 0, 4, 16, 1)))
    assert _check(g, swapped, REFS[::-1], ATTRS[::-1]) == []


def test_a_same_named_kernel_of_another_image_is_a_difference() -> None:
    g = _graph(_k(0), _k(1))
    other = [REFS[0], KernelRef("c" * 64, "gemm")]
    (p,) = _check(g, g, other)
    assert p.startswith("node 1: kernel gemm (image cccccccccccc), captured gemm (image bbbbbbbbbbbb)")


def test_function_attributes_are_compared() -> None:
    g = _graph(_k(0), _k(1))
    lost = [ATTRS[0], dataclasses.replace(ATTRS[1], max_dynamic_shared=0)]
    (p,) = _check(g, g, REFS, lost)
    assert p.startswith("node 1: function attributes") and "max_dynamic_shared=0" in p
    assert structure_problems(g, g, REFS, REFS) == []  # attributes not given: not compared
    unknown = [ATTRS[0], dataclasses.replace(ATTRS[1], carveout=-1)]  # the driver did not say
    assert _check(g, g, REFS, unknown) == []


def test_child_graphs_are_compared_recursively() -> None:
    cap = _graph(_k(0), Node(NodeType.GRAPH, _graph(_k(1, grid=4), _k(0))))
    reb = _graph(_k(0), Node(NodeType.GRAPH, _graph(_k(1, grid=5), _k(0))))
    assert _check(cap, cap) == []
    (p,) = _check(cap, reb)
    assert p == "node 1 (child) node 0: grid differs (gemm)"
    cut = _graph(_k(0), Node(NodeType.GRAPH, Graph((1,), [_k(1, grid=4), _k(0)], [])))
    (p,) = _check(cap, cut)
    assert p.startswith("node 1 (child) edges differ: 0 rebuilt vs 1 captured")


def test_event_nodes_compare_by_their_pattern() -> None:
    cap = _events(3, 3, 4)
    assert _check(cap, _events(0, 0, 1)) == []  # other indices, the same pattern
    assert any("another event" in p for p in _check(cap, _events(0, 1, 1)))
    merged = _events(0, 0, 0)
    assert any("two captured events rebuilt as one" in p for p in _check(cap, merged))


def test_waits_on_events_recorded_outside_the_graph_are_found() -> None:
    inside = _graph(_ev(NodeType.EVENT_RECORD, 0), _k(0), _ev(NodeType.WAIT_EVENT, 0))
    assert external_waits(inside) == []
    outside = _graph(_k(0), _ev(NodeType.WAIT_EVENT, 7), _ev(NodeType.EVENT_RECORD, 2))
    assert external_waits(outside) == [("node 1", 7)]
    # a record in a child graph orders a wait in its parent (and the other way round)
    child = _graph(_ev(NodeType.WAIT_EVENT, 5), Node(NodeType.GRAPH, _graph(_ev(NodeType.EVENT_RECORD, 5))))
    assert external_waits(child) == []
    nested = _graph(_k(0), Node(NodeType.GRAPH, _graph(_k(1), _ev(NodeType.WAIT_EVENT, 9))))
    assert external_waits(nested) == [("node 1 (child) node 1", 9)]
