"""Build (and instantiate) prepared graphs in one call to libember's `ember_build_graphs`
(native/include/ember.h): nodes, attributes and edges added in C on builder threads, edge data
read back and compared there too. What it cannot build is left to `build_graph.build`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ember import settings
from ember.runtime.graphs.prepared import (
    OP_CHILD,
    OP_RECORD,
    OP_SPLICE,
    OP_WAIT,
    NodeArrays,
    PreparedGraph,
    RebuildError,
    arrays_of,
)


def native_threads() -> int:
    """Worker threads for ember_build_graphs: EMBER_BUILD_THREADS, default 1. On H100 with
    driver 580 the driver serialises graph construction: 25 Llama templates took 404 ms on one
    thread, 548 ms on 4 and 637 ms on 16 (benchmarks/results/load-threads-H100-20261122.json)."""
    return max(1, int(settings.number("EMBER_BUILD_THREADS")))


def build_native(
    preps: list[PreparedGraph], ctx: Any, events: Any, *, instantiate: bool, threads: int | None = None,
    interposer: Any = None, splices: Any = None, nodes_out: list[np.ndarray | None] | None = None,
) -> tuple[list[tuple[Any, Any] | None], dict[str, Any]]:
    """Build (and instantiate) graphs with libember's ember_build_graphs (native_threads()
    builder threads unless `threads` is given).

    Returns per graph (CUgraph, CUgraphExec or None), or None where the Python path must build
    it (child graphs, edge data this driver drops with this strategy, no libember here), and
    timings {"wall_ms", "build_cpu_ms", "instantiate_cpu_ms", "threads", "per_graph": [(build
    ms, instantiate ms)]}. A graph the driver
    refuses for any other reason raises RebuildError (libember kept nothing of the batch).
    `splices(i)`: the CUgraph of collective i (graphs with OP_SPLICE nodes need it).
    `nodes_out[i]` (uint64, one per node), where given: filled with graph i's CUgraphNodes."""
    from ember import native

    ip = interposer or _interposer()
    if not settings.on("EMBER_NATIVE_BUILD"):  # diagnosis: the Python path builds all
        ip = None
    out: list[tuple[Any, Any] | None] = [None] * len(preps)
    todo: list[tuple[int, PreparedGraph, NodeArrays]] = []
    if ip is not None:
        todo = [(i, p, a) for i, p in enumerate(preps) if (a := arrays_of(p)) is not None]
    timings: dict[str, Any] = {
        "wall_ms": 0.0, "build_cpu_ms": 0.0, "instantiate_cpu_ms": 0.0, "threads": 0.0, "per_graph": []
    }
    if not todo:
        return out, timings
    descs = (native.GraphDesc * len(todo))()
    keep: list[Any] = []
    for d, (i, p, a) in zip(descs, todo, strict=True):
        keep += _describe(d, p, a, events, splices)
        d.flags = native.BUILD_INSTANTIATE if instantiate else 0
        out_i = nodes_out[i] if nodes_out is not None else None
        if out_i is not None:
            if out_i.dtype != np.uint64 or len(out_i) < len(a.codes) or not out_i.flags.c_contiguous:
                raise ValueError(f"graph {p.key}: nodes_out needs {len(a.codes)} contiguous uint64")
            d.node_handles = out_i.ctypes.data
    n_threads = threads or native_threads()
    t = time.perf_counter()
    ip.build_graphs(int(ctx) if ctx is not None else 0, descs, n_threads)
    timings.update(wall_ms=(time.perf_counter() - t) * 1e3, threads=float(n_threads))
    for d, (i, p, _) in zip(descs, todo, strict=True):
        timings["build_cpu_ms"] += d.build_ns / 1e6
        timings["instantiate_cpu_ms"] += d.instantiate_ns / 1e6
        timings["per_graph"].append((round(d.build_ns / 1e6, 3), round(d.instantiate_ns / 1e6, 3)))
        if d.status == 0 and d.graph:
            out[i] = (cu.CUgraph(d.graph), cu.CUgraphExec(d.exec) if d.exec else None)
        elif d.status not in (0, native.EMBER_EEDGES):  # libember destroyed the whole batch
            node = f"node {d.failed_node}: " if d.failed_node >= 0 else ""
            raise RebuildError(f"graph {p.key}: {node}{d.error.decode(errors='replace')}")
    del keep
    return out, timings


def _describe(d: Any, p: PreparedGraph, a: NodeArrays, events: Any, splices: Any = None) -> list[Any]:
    """Fill one ember_graph_desc; returns the arrays it points into (alive until the call returns)."""
    args, codes = a.args, a.codes
    if (a.codes == OP_RECORD).any() or (a.codes == OP_WAIT).any():
        args = args.copy()
        for j in np.nonzero((a.codes == OP_RECORD) | (a.codes == OP_WAIT))[0].tolist():
            args[j] = int(events[int(a.args[j])])
    spliced = np.nonzero(a.codes == OP_SPLICE)[0].tolist()
    if spliced:
        if splices is None:
            raise RebuildError(f"graph {p.key}: collective placeholders but no communicator to splice")
        args, codes = args.copy(), codes.copy()
        for j in spliced:
            args[j] = int(splices(int(a.args[j])))
            codes[j] = OP_CHILD
    src = np.ascontiguousarray(p.edge_src, dtype=np.uint32)
    dst = np.ascontiguousarray(p.edge_dst, dtype=np.uint32)
    data = np.frombuffer(p.edge_data, dtype=np.uint8) if p.edge_data else None
    d.nodes, d.edges = len(a.codes), len(src)
    d.ops, d.args = codes.ctypes.data, args.ctypes.data
    d.attr_start, d.attr_count = a.attr_start.ctypes.data, a.attr_count.ctypes.data
    d.attr_ids = a.attr_ids.ctypes.data if len(a.attr_ids) else None
    d.attr_values = a.attr_values.ctypes.data if len(a.attr_values) else None
    d.edge_src, d.edge_dst = src.ctypes.data, dst.ctypes.data
    d.edge_data = data.ctypes.data if data is not None else None
    return [args, codes, src, dst, data]


_INTERPOSER: list[Any] = []


def _interposer() -> Any:
    """libember's control API in this process, or None when the library is not to be found
    (or predates ember_build_graphs): the Python path builds then."""
    if not _INTERPOSER:
        from ember import native

        try:
            _INTERPOSER.append(native.Interposer.attach())
        except (OSError, AttributeError):
            _INTERPOSER.append(None)
    return _INTERPOSER[0]
