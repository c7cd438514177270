"""Build one prepared graph into a CUgraph from Python: add its nodes, then its edges with their
edge data, read the edges back and compare (driver calls; the thread that owns the driver).

The Python builder serves what libember's builder (`build_native`) leaves: child graphs, graphs
whose edge data needs another strategy, processes without libember. Kernel nodes go straight to
the driver's C entry points with the structs `prepare_graph` / `prepare_table` packed: a
cuda.bindings call per node costs several times the driver's own work on 2,000-node graphs.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ember.runtime.graphs import driver
from ember.runtime.graphs.driver import OK, CudaError, check
from ember.runtime.graphs.prepared import (
    OP_EMPTY,
    OP_KERNEL,
    OP_MEMCPY,
    OP_MEMSET,
    OP_RECORD,
    OP_SPLICE,
    OP_WAIT,
    EdgeDataLost,
    PreparedGraph,
    RebuildError,
    ops_of,
)

_ATTR_ENUM = {int(a): a for a in cu.CUkernelNodeAttrID}

# How edges with edge data are added. Seen on H200, driver 580.159.04 (benchmarks/results/
# graphs-2026-11-22.md): ONE cuGraphAddDependencies(_v2) call with a mixed list (default edges
# first) succeeded and kept NO programmatic edge data, through cuda.bindings and through the C
# entry point alike, while a call adding a single programmatic edge kept it. Strategies are tried
# in this order until the read-back matches; the first that works is kept for the process.
EDGE_STRATEGIES: tuple[str, ...] = ("nondefault-single-first", "all-single", "batched")
_edge_strategy = [0]


def edge_strategy() -> str:
    """The edge strategy this process uses now (reported by the proof and LOAD timings)."""
    return EDGE_STRATEGIES[_edge_strategy[0]]


def build(prep: PreparedGraph, ctx: Any, events: Any, splices: Any = None, nodes_out: Any = None) -> Any:
    """Create the CUgraph of a prepared graph (driver calls; one thread). `nodes_out` (uint64, one
    per node), where given: filled with its CUgraphNodes.

    Edge data is read back after the edges are added; if the driver dropped it, the graph is
    built again with the next strategy of EDGE_STRATEGIES (see there), and a graph whose edge data
    no strategy keeps is a RebuildError: never a silently different graph."""
    while True:
        strategy = EDGE_STRATEGIES[_edge_strategy[0]]
        g = check(cu.cuGraphCreate(0), "cuGraphCreate")
        try:
            nodes = _add_nodes_and_edges(g, prep, ctx, events, strategy, splices)
            if nodes_out is not None:
                nodes_out[: len(nodes)] = [int(n) for n in nodes]
            return g
        except EdgeDataLost as exc:
            cu.cuGraphDestroy(g)
            if _edge_strategy[0] + 1 >= len(EDGE_STRATEGIES):
                raise RebuildError(
                    f"{exc} (every edge strategy tried: {', '.join(EDGE_STRATEGIES)})"
                ) from None
            _edge_strategy[0] += 1
        except BaseException:
            cu.cuGraphDestroy(g)
            raise


def instantiate(graph: Any) -> Any:
    return check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")


def _err_name(rc: int) -> str:
    try:
        return cu.CUresult(rc).name
    except ValueError:
        return str(rc)


def _add_nodes_and_edges(
    g: Any, prep: PreparedGraph, ctx: Any, events: Any, strategy: str, splices: Any = None
) -> list[Any]:
    nodes: list[Any] = []
    append = nodes.append
    out = ctypes.c_uint64(0)
    out_ref = ctypes.byref(out)
    ops = ops_of(prep)
    if any(op[0] == OP_KERNEL for op in ops):
        add_kernel, set_attr = driver.kernel_node_fns()
    for i, op in enumerate(ops):
        code = op[0]
        if code == OP_KERNEL:
            rc = add_kernel(out_ref, int(g), None, 0, op[1])
            if rc != 0:
                raise RebuildError(f"graph {prep.key}: node {i}: kernel node not added: {_err_name(rc)}")
            node = out.value
            for attr, addr in op[2]:
                rc = set_attr(node, attr, addr)
                if rc != 0:
                    name = _ATTR_ENUM[attr].name
                    raise RebuildError(
                        f"graph {prep.key}: node {i}: set attribute {name} failed: {_err_name(rc)}"
                    )
            append(node)
            continue
        elif code == OP_MEMSET:
            err, node = cu.cuGraphAddMemsetNode(g, None, 0, op[1], ctx)
        elif code == OP_MEMCPY:
            err, node = cu.cuGraphAddMemcpyNode(g, None, 0, op[1], ctx)
        elif code == OP_EMPTY:
            err, node = cu.cuGraphAddEmptyNode(g, None, 0)
        elif code == OP_RECORD:
            err, node = cu.cuGraphAddEventRecordNode(g, None, 0, events[op[1]])
        elif code == OP_WAIT:
            err, node = cu.cuGraphAddEventWaitNode(g, None, 0, events[op[1]])
        elif code == OP_SPLICE:
            if splices is None:
                raise RebuildError(f"graph {prep.key}: node {i}: a collective placeholder, no communicator")
            err, node = cu.cuGraphAddChildGraphNode(g, None, 0, splices(op[1]))
        else:  # OP_CHILD
            child = build(op[1], ctx, events, splices)  # its own edges verified (and strategy chosen) inside
            try:
                err, node = cu.cuGraphAddChildGraphNode(g, None, 0, child)
            finally:
                cu.cuGraphDestroy(child)
        if err != OK:
            raise RebuildError(f"graph {prep.key}: node {i}: adding the node failed: {err}")
        append(node)
    add_edges(g, prep, nodes, strategy)
    return nodes


def add_edges(g: Any, prep: PreparedGraph, nodes: list[Any], strategy: str = EDGE_STRATEGIES[0]) -> None:
    """Add all edges with their edge data through the driver's C entry point
    (driver.add_dependencies), then, when any edge is not a default edge, read them back (one
    driver call): edge data the driver did not keep raises EdgeDataLost.

    Strategies (EDGE_STRATEGIES): "batched" = one call for all edges; "nondefault-single-first"
    = every non-default edge in a call of its own, then the default edges in one call without
    edge data; "all-single" = one call per edge in order. Without edge data: always one call.
    """
    if len(prep.edge_src) == 0:
        return
    src = [int(nodes[a]) for a in prep.edge_src]
    dst = [int(nodes[b]) for b in prep.edge_dst]
    data = prep.edge_data
    size = driver.EDGE_DATA_SIZE
    try:
        if data is None or strategy == "batched":
            driver.add_dependencies(g, src, dst, data)
        elif strategy == "all-single":
            for j in range(len(src)):
                driver.add_dependencies(g, [src[j]], [dst[j]], data[size * j : size * (j + 1)])
        elif strategy == "nondefault-single-first":
            default = bytes(size)
            plain = []
            for j in range(len(src)):
                one = data[size * j : size * (j + 1)]
                if one == default:
                    plain.append(j)
                else:
                    driver.add_dependencies(g, [src[j]], [dst[j]], one)
            if plain:
                driver.add_dependencies(g, [src[j] for j in plain], [dst[j] for j in plain], None)
        else:
            raise ValueError(f"unknown edge strategy {strategy!r}")
    except CudaError as exc:
        raise RebuildError(f"graph {prep.key}: {exc}") from None
    if data is not None:
        problem = edge_data_problem(prep, nodes, driver.graph_edges(g))
        if problem:
            raise EdgeDataLost(f"graph {prep.key}: edge data lost when adding edges ({strategy}): {problem}")


def edge_data_problem(
    prep: PreparedGraph, nodes: list[Any], read_back: tuple[list[int], list[int], bytes]
) -> str:
    """What differs between the edges a prepared graph asked for and those the driver holds
    (as multisets of (src, dst, from_port, to_port, type)); empty when identical."""
    index = {int(n): i for i, n in enumerate(nodes)}
    frm, to, data = read_back
    size = driver.EDGE_DATA_SIZE
    want_data = prep.edge_data or bytes(size * len(prep.edge_src))
    try:
        got_src = [index[a] for a in frm]
        got_dst = [index[b] for b in to]
    except KeyError:
        return "an edge names a node that is not in the graph"
    want = _edge_keys(prep.edge_src, prep.edge_dst, want_data)
    got = _edge_keys(got_src, got_dst, data)
    if np.array_equal(want, got):
        return ""
    prog_want = int((want[:, 4] != 0).sum())
    prog_got = int((got[:, 4] != 0).sum())
    return f"{len(got)} edges ({prog_got} non-default) read back, {len(want)} ({prog_want} non-default) added"


def _edge_keys(src: list[int], dst: list[int], data: bytes) -> np.ndarray:
    """Edges as sorted rows (src, dst, from_port, to_port, type): a multiset in one array."""
    d = np.frombuffer(data, dtype=np.uint8).reshape(-1, driver.EDGE_DATA_SIZE)[: len(src), :3]
    ends = np.asarray([src, dst], dtype=np.int64).reshape(2, -1).T
    rows = np.column_stack([ends, d.astype(np.int64)])
    return rows[np.lexsort(rows.T[::-1])]
