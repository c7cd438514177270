"""LOAD side: `graphs.Graph` → a new CUgraph, in two steps.

`prepare()` does all the CPU work without driver calls (it can run on worker threads): per
kernel node it packs a CUDA_KERNEL_NODE_PARAMS struct (function handle, dims, a kernelParams
pointer array into one argument buffer, or the `extra` option list around the opaque blob) and
the non-default attribute values, all in buffers the PreparedGraph keeps alive. `build()` then
only adds nodes, sets attributes and adds all edges with their edge data in one call, on the
thread that owns the driver (graph APIs contend across threads).

Missing attributes are not cosmetic: a node that loses its cluster dimension dies with
CUDA_ERROR_ILLEGAL_INSTRUCTION, a sticky error that takes the process. So SAVE proves every
rebuilt graph before an archive is published (see ember.runtime.proof.prove).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ember.archive.graphs import (
    EventParams,
    FunctionAttrs,
    Graph,
    GraphSet,
    KernelParams,
    MemcpyParams,
    MemsetParams,
    NodeType,
)
from ember.runtime.graphs import driver
from ember.runtime.graphs.driver import OK, CudaError, check
from ember.runtime.graphs.walk import ATTR_SIZES, ATTR_VALUE_SIZE, KERNEL_PARAMS

_ATTR_ENUM = {int(a): a for a in cu.CUkernelNodeAttrID}
_FA = cu.CUfunction_attribute

# Op codes of a prepared graph.
OP_KERNEL, OP_MEMSET, OP_MEMCPY, OP_EMPTY, OP_RECORD, OP_WAIT, OP_CHILD = range(7)


class RebuildError(RuntimeError):
    """A graph could not be rebuilt; names the graph key and node."""


class EdgeDataLost(RebuildError):
    """The driver accepted the edges but does not hold their edge data (read back)."""


# How edges with edge data are added. Seen on H200, driver 580.159.04 (benchmarks/results/
# graphs-2026-11-22.md): ONE cuGraphAddDependencies(_v2) call with a mixed list (default edges
# first) succeeded and kept NO programmatic edge data, through cuda.bindings and through the C
# entry point alike, while a call adding a single programmatic edge kept it. Strategies are tried
# in this order until the read-back matches; the first that works is kept for the process.
EDGE_STRATEGIES: tuple[str, ...] = ("nondefault-single-first", "all-single", "batched")
_edge_strategy = [0]


@dataclass
class NodeArrays:
    """A graph's nodes as ember_build_graphs takes them (include/ember.h): an op code and an
    argument per node (struct address; for events the event INDEX, resolved at build time),
    kernel attributes as (id, value address) ranges; `objects` holds the memset/memcpy structs
    by node index (the Python path passes the objects, the native path their addresses)."""

    codes: np.ndarray  # uint8
    args: np.ndarray  # uint64
    attr_start: np.ndarray  # uint32 per node
    attr_count: np.ndarray  # uint32 per node
    attr_ids: np.ndarray  # uint32
    attr_values: np.ndarray  # uint64
    objects: dict[int, Any] = field(default_factory=dict)


@dataclass
class PreparedGraph:
    key: tuple[int, ...]
    ops: list[tuple[Any, ...]]  # empty when `arrays` is given: derived on demand (ops_of)
    edge_src: Any  # node indices (list or uint32 array)
    edge_dst: Any
    edge_data: bytes | None  # CUgraphEdgeData array (8 bytes per edge); None when all are default
    keepalive: list[Any] = field(default_factory=list)
    nodes: int = 0
    arrays: NodeArrays | None = None


def pack_arguments(params: KernelParams) -> tuple[bytes, tuple[int, ...]]:
    """The argument buffer and the offsets of each argument (CPU-testable half of repacking)."""
    if params.extra is not None:
        return params.extra, ()
    if len(params.arg_offsets) != len(params.arg_sizes):
        raise ValueError("argument offsets and sizes differ in length")
    end = params.arg_offsets[-1] + params.arg_sizes[-1] if params.arg_offsets else 0
    if len(params.args) < end:
        raise ValueError(f"argument buffer holds {len(params.args)} bytes, layout needs {end}")
    return params.args, params.arg_offsets


def prepare(graph: Graph, functions: list[int], ctx: Any, memset_ctx: Any = None) -> PreparedGraph:
    """CPU-only preparation of one graph (no driver calls; thread-safe)."""
    kernels = [n.params for n in graph.nodes if n.type == NodeType.KERNEL]
    nk = len(kernels)
    # One struct array for all kernel nodes, one argument arena, one pointer arena.
    structs = np.zeros(nk * KERNEL_PARAMS.size, dtype=np.uint8)
    arena_len = sum(len(p.extra) if p.extra is not None else len(p.args) for p in kernels)
    arena = np.zeros(max(arena_len, 8), dtype=np.uint8)
    n_ptrs = sum(len(p.arg_offsets) if p.extra is None else 6 for p in kernels)
    ptrs = np.zeros(max(n_ptrs, 1), dtype=np.uint64)
    arena_base, ptr_base, struct_base = arena.ctypes.data, ptrs.ctypes.data, structs.ctypes.data
    attr_buf_len = sum(len(p.attrs) for p in kernels) * ATTR_VALUE_SIZE
    attr_buf = np.zeros(max(attr_buf_len, 8), dtype=np.uint8)
    attr_base = attr_buf.ctypes.data

    ops: list[tuple[Any, ...]] = []
    a_off = p_off = k = at_off = 0
    pack = KERNEL_PARAMS.pack_into
    structs_mv, arena_mv, attr_mv = structs.data, arena.data, attr_buf.data  # writable views
    for idx, node in enumerate(graph.nodes):
        t = node.type
        if t == NodeType.KERNEL:
            p: KernelParams = node.params  # type: ignore[assignment]
            try:
                func = functions[p.kernel]
            except IndexError:
                raise RebuildError(
                    f"graph {graph.key}: node {idx}: kernel index {p.kernel} out of range"
                ) from None
            blob, offsets = pack_arguments(p)
            arena_mv[a_off : a_off + len(blob)] = blob
            kparams = extra = 0
            if p.extra is not None:
                # {BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END}; the size word sits in slot 5.
                ptrs[p_off : p_off + 6] = (1, arena_base + a_off, 2, ptr_base + (p_off + 5) * 8, 0, len(blob))
                extra = ptr_base + p_off * 8
                p_off += 6
            elif offsets:
                n = len(offsets)
                ptrs[p_off : p_off + n] = np.asarray(offsets, dtype=np.uint64) + np.uint64(arena_base + a_off)
                kparams = ptr_base + p_off * 8
                p_off += n
            a_off += len(blob)
            gx, gy, gz = p.grid
            bx, by, bz = p.block
            so = k * KERNEL_PARAMS.size
            pack(structs_mv, so, func, gx, gy, gz, bx, by, bz, p.shared_mem, kparams, extra, 0, 0)
            attrs: list[tuple[int, int]] = []
            for a, raw in p.attrs.items():
                if a not in ATTR_SIZES:
                    continue  # launch-only attributes never go on a node (see walk.ATTR_SIZES)
                if len(raw) != ATTR_VALUE_SIZE:
                    raise RebuildError(f"graph {graph.key}: node {idx}: attribute {a} has {len(raw)} bytes")
                attr_mv[at_off : at_off + ATTR_VALUE_SIZE] = raw
                attrs.append((a, attr_base + at_off))
                at_off += ATTR_VALUE_SIZE
            ops.append((OP_KERNEL, struct_base + so, attrs))
            k += 1
        elif t == NodeType.MEMSET:
            m: MemsetParams = node.params  # type: ignore[assignment]
            mp = cu.CUDA_MEMSET_NODE_PARAMS()
            mp.dst, mp.pitch, mp.value = m.dst, m.pitch, m.value
            mp.elementSize, mp.width, mp.height = m.element_size, m.width, m.height
            ops.append((OP_MEMSET, mp))
        elif t == NodeType.MEMCPY:
            c: MemcpyParams = node.params  # type: ignore[assignment]
            cp = cu.CUDA_MEMCPY3D()
            cp.srcMemoryType = cp.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            cp.srcDevice, cp.dstDevice = c.src, c.dst
            cp.WidthInBytes, cp.Height, cp.Depth = c.size, 1, 1
            ops.append((OP_MEMCPY, cp))
        elif t == NodeType.EMPTY:
            ops.append((OP_EMPTY,))
        elif t in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            e: EventParams = node.params  # type: ignore[assignment]
            ops.append((OP_RECORD if t == NodeType.EVENT_RECORD else OP_WAIT, e.event))
        elif t == NodeType.GRAPH:
            ops.append((OP_CHILD, prepare(node.params, functions, ctx)))  # type: ignore[arg-type]
        else:
            raise RebuildError(f"graph {graph.key}: node {idx}: node type {t.name} cannot be rebuilt")

    # Edges grouped by destination (stable): each node's dependencies in capture order, as
    # stream capture created them; the same order for every graph of a group (exec update).
    edges = sorted(graph.edges, key=lambda e: e.dst)
    src = [e.src for e in edges]
    dst = [e.dst for e in edges]
    data = None
    if any(e.type or e.from_port or e.to_port for e in edges):
        data = driver.pack_edge_data([(e.from_port, e.to_port, e.type) for e in edges])
    return PreparedGraph(
        key=graph.key,
        ops=ops,
        edge_src=src,
        edge_dst=dst,
        edge_data=data,
        keepalive=[structs, arena, ptrs, attr_buf],
        nodes=len(graph.nodes),
    )


def ops_of(prep: PreparedGraph) -> list[tuple[Any, ...]]:
    """The Python path's op list (derived from the arrays of a table-prepared graph)."""
    if prep.ops or prep.arrays is None:
        return prep.ops
    a = prep.arrays
    ops: list[tuple[Any, ...]] = []
    ids, vals = a.attr_ids.tolist(), a.attr_values.tolist()
    for i, (code, arg, s0, n) in enumerate(
        zip(a.codes.tolist(), a.args.tolist(), a.attr_start.tolist(), a.attr_count.tolist(), strict=True)
    ):
        if code == OP_KERNEL:
            ops.append((OP_KERNEL, arg, list(zip(ids[s0 : s0 + n], vals[s0 : s0 + n], strict=True))))
        elif code in (OP_MEMSET, OP_MEMCPY):
            ops.append((code, a.objects[i]))
        elif code in (OP_RECORD, OP_WAIT):
            ops.append((code, arg))
        else:
            ops.append((code,))
    prep.ops = ops
    return ops


def arrays_of(prep: PreparedGraph) -> NodeArrays | None:
    """The native path's arrays (derived from the op list of a Graph-prepared graph); None when
    the graph has child graphs (the native builder does not nest: the Python path builds those)."""
    if prep.arrays is not None:
        return prep.arrays
    n = len(prep.ops)
    codes = np.zeros(n, dtype=np.uint8)
    args = np.zeros(n, dtype=np.uint64)
    start = np.zeros(n, dtype=np.uint32)
    count = np.zeros(n, dtype=np.uint32)
    ids: list[int] = []
    vals: list[int] = []
    objects: dict[int, Any] = {}
    for i, op in enumerate(prep.ops):
        code = op[0]
        if code == OP_CHILD:
            return None
        codes[i] = code
        if code == OP_KERNEL:
            args[i] = op[1]
            start[i], count[i] = len(ids), len(op[2])
            for a, v in op[2]:
                ids.append(a)
                vals.append(v)
        elif code in (OP_MEMSET, OP_MEMCPY):
            objects[i] = op[1]
            args[i] = int(op[1].getPtr())
        elif code in (OP_RECORD, OP_WAIT):
            args[i] = op[1]
    attr_ids, attr_values = np.asarray(ids, dtype=np.uint32), np.asarray(vals, dtype=np.uint64)
    prep.arrays = NodeArrays(codes, args, start, count, attr_ids, attr_values, objects)
    return prep.arrays


def native_threads() -> int:
    """Worker threads for ember_build_graphs: EMBER_BUILD_THREADS, default 1. On H100 with
    driver 580 the driver serialises graph construction: 25 Llama templates took 404 ms on one
    thread, 548 ms on 4 and 637 ms on 16 (benchmarks/results/load-threads-*.json)."""
    import os

    env = os.environ.get("EMBER_BUILD_THREADS", "")
    return max(1, int(env)) if env.isdigit() else 1


def build_native(
    preps: list[PreparedGraph], ctx: Any, events: Any, *, instantiate: bool, threads: int | None = None,
    interposer: Any = None,
) -> tuple[list[tuple[Any, Any] | None], dict[str, float]]:
    """Build (and instantiate) graphs with libember's ember_build_graphs (native_threads()
    builder threads unless `threads` is given).

    Returns per graph (CUgraph, CUgraphExec or None), or None where the Python path must build
    it (child graphs, edge data this driver drops with this strategy, no libember here), and
    timings {"wall_ms", "build_cpu_ms", "instantiate_cpu_ms", "threads"}. A graph the driver
    refuses for any other reason raises RebuildError (libember kept nothing of the batch)."""
    import os
    import time

    from ember import native

    ip = interposer or _interposer()
    if os.environ.get("EMBER_NATIVE_BUILD", "1") == "0":  # diagnosis: the Python path builds all
        ip = None
    out: list[tuple[Any, Any] | None] = [None] * len(preps)
    todo = [(i, p, arrays_of(p)) for i, p in enumerate(preps)] if ip is not None else []
    todo = [(i, p, a) for i, p, a in todo if a is not None]
    timings = {"wall_ms": 0.0, "build_cpu_ms": 0.0, "instantiate_cpu_ms": 0.0, "threads": 0.0}
    if not todo:
        return out, timings
    descs = (native.GraphDesc * len(todo))()
    keep: list[Any] = []
    for d, (_, p, a) in zip(descs, todo, strict=True):
        args = a.args
        if (a.codes == OP_RECORD).any() or (a.codes == OP_WAIT).any():
            args = args.copy()
            for j in np.nonzero((a.codes == OP_RECORD) | (a.codes == OP_WAIT))[0].tolist():
                args[j] = int(events[int(a.args[j])])
        src = np.ascontiguousarray(p.edge_src, dtype=np.uint32)
        dst = np.ascontiguousarray(p.edge_dst, dtype=np.uint32)
        data = np.frombuffer(p.edge_data, dtype=np.uint8) if p.edge_data else None
        keep += [args, src, dst, data]
        d.nodes, d.edges = len(a.codes), len(src)
        d.ops, d.args = a.codes.ctypes.data, args.ctypes.data
        d.attr_start, d.attr_count = a.attr_start.ctypes.data, a.attr_count.ctypes.data
        d.attr_ids = a.attr_ids.ctypes.data if len(a.attr_ids) else None
        d.attr_values = a.attr_values.ctypes.data if len(a.attr_values) else None
        d.edge_src, d.edge_dst = src.ctypes.data, dst.ctypes.data
        d.edge_data = data.ctypes.data if data is not None else None
        d.flags = native.BUILD_INSTANTIATE if instantiate else 0
    n_threads = threads or native_threads()
    t = time.perf_counter()
    ip.build_graphs(int(ctx) if ctx is not None else 0, descs, n_threads)
    timings.update(wall_ms=(time.perf_counter() - t) * 1e3, threads=float(n_threads))
    for d, (i, p, _) in zip(descs, todo, strict=True):
        timings["build_cpu_ms"] += d.build_ns / 1e6
        timings["instantiate_cpu_ms"] += d.instantiate_ns / 1e6
        if d.status == 0 and d.graph:
            out[i] = (cu.CUgraph(d.graph), cu.CUgraphExec(d.exec) if d.exec else None)
        elif d.status not in (0, native.EMBER_EEDGES):  # libember destroyed the whole batch
            node = f"node {d.failed_node}: " if d.failed_node >= 0 else ""
            raise RebuildError(f"graph {p.key}: {node}{d.error.decode(errors='replace')}")
    del keep
    return out, timings


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


def build(prep: PreparedGraph, ctx: Any, events: Any) -> Any:
    """Create the CUgraph of a prepared graph (driver calls; one thread).

    Edge data is read back after the edges are added; if the driver dropped it, the graph is
    built again with the next strategy of EDGE_STRATEGIES (see there), and a graph whose edge data
    no strategy keeps is a RebuildError: never a silently different graph."""
    while True:
        strategy = EDGE_STRATEGIES[_edge_strategy[0]]
        g = check(cu.cuGraphCreate(0), "cuGraphCreate")
        try:
            _fill(g, prep, ctx, events, strategy)
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


def _err_name(rc: int) -> str:
    try:
        return cu.CUresult(rc).name
    except ValueError:
        return str(rc)


def edge_strategy() -> str:
    """The edge strategy this process uses now (reported by the proof and LOAD timings)."""
    return EDGE_STRATEGIES[_edge_strategy[0]]


def _fill(g: Any, prep: PreparedGraph, ctx: Any, events: Any, strategy: str) -> None:
    # Kernel nodes (nearly all of them) go straight to the driver's C entry points with the
    # structs prepare() packed: a cuda.bindings call per node costs several times the driver's
    # own work on 2,000-node graphs.
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
        else:  # OP_CHILD
            child = build(op[1], ctx, events)  # its own edges verified (and strategy chosen) inside
            try:
                err, node = cu.cuGraphAddChildGraphNode(g, None, 0, child)
            finally:
                cu.cuGraphDestroy(child)
        if err != OK:
            raise RebuildError(f"graph {prep.key}: node {i}: adding the node failed: {err}")
        append(node)
    add_edges(g, prep, nodes, strategy)


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


def instantiate(graph: Any) -> Any:
    return check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")


def apply_function_attrs(functions: list[int], attrs: list[FunctionAttrs]) -> None:
    """Re-apply per-function state recorded at SAVE where the loaded function differs."""
    for func, fa in zip(functions, attrs, strict=True):
        f = cu.CUfunction(func)
        wanted = [
            (_FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, fa.max_dynamic_shared),
            (_FA.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, fa.non_portable_cluster),
            (_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, fa.required_cluster[0]),
            (_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT, fa.required_cluster[1]),
            (_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH, fa.required_cluster[2]),
        ]
        if fa.carveout >= 0:
            wanted.append((_FA.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, fa.carveout))
        for attr, value in wanted:
            err, cur = cu.cuFuncGetAttribute(attr, f)
            if err == OK and int(cur) == value:
                continue
            r = cu.cuFuncSetAttribute(f, attr, value)
            if r[0] != OK:
                raise CudaError(f"cuFuncSetAttribute({attr.name}={value})", r[0])


def create_events(count: int) -> list[Any]:
    flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    return [check(cu.cuEventCreate(flags), "cuEventCreate") for _ in range(count)]


def event_count(graph_set: GraphSet) -> int:
    def walk(g: Graph) -> int:
        top = -1
        for n in g.nodes:
            if isinstance(n.params, EventParams):
                top = max(top, n.params.event)
            elif n.type == NodeType.GRAPH:
                top = max(top, walk(n.params) - 1)  # type: ignore[arg-type]
        return top + 1

    return max((walk(g) for g in graph_set.graphs), default=0)


def extra_size_word(raw: bytes) -> int:
    """The size slot of an `extra` option list as packed by prepare() (for tests)."""
    return struct.unpack_from("<Q", raw, 5 * 8)[0]


__all__ = [
    "PreparedGraph",
    "RebuildError",
    "apply_function_attrs",
    "build",
    "create_events",
    "event_count",
    "instantiate",
    "pack_arguments",
    "prepare",
]


# ---- fast path: prepare straight from a decoded graph table chunk (numpy, no Graph objects) ----
_KP_DT = np.dtype(
    [
        ("func", "<u8"),
        ("gx", "<u4"),
        ("gy", "<u4"),
        ("gz", "<u4"),
        ("bx", "<u4"),
        ("by", "<u4"),
        ("bz", "<u4"),
        ("smem", "<u4"),
        ("pad", "<u4"),
        ("kp", "<u8"),
        ("extra", "<u8"),
        ("kern", "<u8"),
        ("ctx", "<u8"),
    ]
)
assert _KP_DT.itemsize == KERNEL_PARAMS.size
_OP_OF_TYPE = {
    int(NodeType.KERNEL): OP_KERNEL,
    int(NodeType.MEMSET): OP_MEMSET,
    int(NodeType.MEMCPY): OP_MEMCPY,
    int(NodeType.EMPTY): OP_EMPTY,
    int(NodeType.EVENT_RECORD): OP_RECORD,
    int(NodeType.WAIT_EVENT): OP_WAIT,
}


class _AttrSets:
    """Attribute value objects per attribute-set index of a table, shared by all nodes using them."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.sets: dict[int, list[tuple[int, int]]] = {0: []}
        self.buffers: list[np.ndarray] = []

    def get(self, idx: int) -> list[tuple[int, int]]:
        found = self.sets.get(idx)
        if found is None:
            values = {a: v for a, v in self.table._attrs(idx).items() if a in ATTR_SIZES}
            buf = np.zeros(max(len(values), 1) * ATTR_VALUE_SIZE, dtype=np.uint8)
            self.buffers.append(buf)
            found = []
            for n, (a, raw) in enumerate(sorted(values.items())):
                if len(raw) != ATTR_VALUE_SIZE:
                    raise RebuildError(f"attribute {a} has {len(raw)} bytes")
                buf[n * ATTR_VALUE_SIZE : (n + 1) * ATTR_VALUE_SIZE] = np.frombuffer(raw, dtype=np.uint8)
                found.append((a, buf.ctypes.data + n * ATTR_VALUE_SIZE))
            self.sets[idx] = found
        return found


def prepare_from_table(
    table: Any, i: int, functions: list[int], ctx: Any, attr_sets: _AttrSets
) -> PreparedGraph:
    """Like prepare(table.graph(i)) without materialising Python node objects (LOAD's hot path)."""
    from ember.archive.graph_table import KPAR_EXTRA, NONE

    types = np.asarray(table.node_types(i))
    if (types == int(NodeType.GRAPH)).any():
        return prepare(table.graph(i), functions, ctx)
    key = table.keys[i]
    c = table.chunk(i)
    refs = np.asarray(c.refs)
    kmask = types == int(NodeType.KERNEL)
    krows = c.kpar[refs[kmask]]
    nk = len(krows)
    bpol = np.frombuffer(c.raw, dtype=np.uint8) if len(c.bpol) == 0 else c.bpol
    base = np.uint64(bpol.ctypes.data)
    is_extra = (krows["flags"] & KPAR_EXTRA) != 0
    lay = krows["layout"].astype(np.int64)
    has_lay = (~is_extra) & (lay != NONE)
    layo = table._layo
    counts = np.zeros(nk, dtype=np.int64)
    counts[has_lay] = layo["count"][lay[has_lay]]
    slots = np.where(is_extra, 6, counts)
    starts = np.zeros(nk, dtype=np.int64)
    if nk:
        starts[1:] = np.cumsum(slots)[:-1]
    ptrs = np.zeros(max(int(slots.sum()), 1), dtype=np.uint64)
    ptr_base = np.uint64(ptrs.ctypes.data)
    args_off = krows["args_off"].astype(np.uint64)
    # kernelParams form: one pointer per argument, into the chunk's byte pool.
    kc = np.where(has_lay, counts, 0)
    total = int(kc.sum())
    if total:
        node = np.repeat(np.arange(nk), kc)
        within = np.arange(total) - np.repeat(np.cumsum(kc) - kc, kc)
        lpar_idx = np.repeat(layo["off"][np.where(has_lay, lay, 0)].astype(np.int64), kc) + within
        ptrs[starts[node] + within] = (
            base + args_off[node] + table._lpar["offset"][lpar_idx].astype(np.uint64)
        )
    # extra form: {BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END, size}.
    ex = np.nonzero(is_extra)[0]
    if len(ex):
        s = starts[ex]
        ptrs[s] = 1
        ptrs[s + 1] = base + args_off[ex]
        ptrs[s + 2] = 2
        ptrs[s + 3] = ptr_base + (s + 5).astype(np.uint64) * np.uint64(8)
        ptrs[s + 4] = 0
        ptrs[s + 5] = krows["args_len"][ex].astype(np.uint64)
    st = np.zeros(nk, dtype=_KP_DT)
    st["func"] = np.asarray(functions, dtype=np.uint64)[krows["kernel"]] if nk else 0
    for f in ("gx", "gy", "gz", "bx", "by", "bz", "smem"):
        st[f] = krows[f]
    slot_addr = ptr_base + starts.astype(np.uint64) * np.uint64(8)
    st["kp"] = np.where(has_lay & (counts > 0), slot_addr, 0)
    st["extra"] = np.where(is_extra, slot_addr, 0)
    n = len(types)
    codes = np.full(n, 255, dtype=np.uint8)
    for node_type, op in _OP_OF_TYPE.items():
        codes[types == node_type] = op
    if (codes == 255).any():
        bad = int(types[np.argmax(codes == 255)])
        raise RebuildError(f"graph {key}: node type {bad} cannot be rebuilt")
    args = np.zeros(n, dtype=np.uint64)
    args[kmask] = np.uint64(st.ctypes.data) + np.arange(nk, dtype=np.uint64) * np.uint64(KERNEL_PARAMS.size)
    objects: dict[int, Any] = {}
    for j in np.nonzero(~kmask)[0].tolist():
        t, ref = int(types[j]), int(refs[j])
        if t == NodeType.MEMSET:
            dst, pitch, value, es, w, h = c.mset[ref].tolist()
            objects[j] = _memset(MemsetParams(dst, pitch, value, es, w, h))
        elif t == NodeType.MEMCPY:
            dst, src, nbytes = c.mcpy[ref].tolist()
            objects[j] = _memcpy(MemcpyParams(dst, src, nbytes))
        elif t in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            args[j] = ref  # the event index; build resolves it to this process's CUevent
        if j in objects:
            args[j] = int(objects[j].getPtr())
    # Kernel attributes: each distinct attribute set once, every kernel node a range into it.
    attr_start = np.zeros(n, dtype=np.uint32)
    attr_count = np.zeros(n, dtype=np.uint32)
    ids: list[int] = []
    vals: list[int] = []
    if nk:
        sets, inverse = np.unique(krows["attrs"], return_inverse=True)
        set_start, set_count = [], []
        for set_index in sets.tolist():
            pairs = attr_sets.get(int(set_index))
            set_start.append(len(ids))
            set_count.append(len(pairs))
            ids += [a for a, _ in pairs]
            vals += [v for _, v in pairs]
        attr_start[kmask] = np.asarray(set_start, dtype=np.uint32)[inverse]
        attr_count[kmask] = np.asarray(set_count, dtype=np.uint32)[inverse]
    arrays = NodeArrays(
        codes, args, attr_start, attr_count,
        np.asarray(ids, dtype=np.uint32), np.asarray(vals, dtype=np.uint64), objects,
    )
    e = table.edges(i)
    e = e[np.argsort(e["dst"], kind="stable")]  # as prepare(): grouped by destination, stable
    src, dst = e["src"].astype(np.uint32), e["dst"].astype(np.uint32)
    data = None
    nondefault = (e["type"] != 0) | (e["from_port"] != 0) | (e["to_port"] != 0)
    if nondefault.any():
        packed = np.zeros((len(src), driver.EDGE_DATA_SIZE), dtype=np.uint8)
        packed[:, 0], packed[:, 1], packed[:, 2] = e["from_port"], e["to_port"], e["type"]
        data = packed.tobytes()
    return PreparedGraph(
        key=key,
        ops=[],
        edge_src=src,
        edge_dst=dst,
        edge_data=data,
        keepalive=[st, ptrs, c, bpol],
        nodes=n,
        arrays=arrays,
    )


def _memset(m: MemsetParams) -> Any:
    mp = cu.CUDA_MEMSET_NODE_PARAMS()
    mp.dst, mp.pitch, mp.value = m.dst, m.pitch, m.value
    mp.elementSize, mp.width, mp.height = m.element_size, m.width, m.height
    return mp


def _memcpy(c: MemcpyParams) -> Any:
    cp = cu.CUDA_MEMCPY3D()
    cp.srcMemoryType = cp.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    cp.srcDevice, cp.dstDevice = c.src, c.dst
    cp.WidthInBytes, cp.Height, cp.Depth = c.size, 1, 1
    return cp
