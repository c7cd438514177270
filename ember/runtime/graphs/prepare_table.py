"""Prepare a graph straight from a decoded graph table's chunk: LOAD's hot path.

The same result as `prepare_graph.prepare(table.graph(i))` (tests/unit/test_runtime_rebuild.py
compares them), computed with numpy over the chunk's param rows instead of per Python node object:
it runs for every node of every template at LOAD. Each step below is one vectorised pass over a
graph: argument pointers, kernel structs, node codes, attribute ranges, edges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.archive.graphs import MemcpyParams, MemsetParams, NodeType
from ember.runtime import faults
from ember.runtime.graphs import driver
from ember.runtime.graphs.kernels import Functions, handles
from ember.runtime.graphs.prepare_graph import EXTRA_SLOTS, memcpy_struct, memset_struct, prepare
from ember.runtime.graphs.prepared import (
    OP_EMPTY,
    OP_KERNEL,
    OP_MEMCPY,
    OP_MEMSET,
    OP_RECORD,
    OP_WAIT,
    NodeArrays,
    PreparedGraph,
    RebuildError,
)
from ember.runtime.graphs.walk import ATTR_SIZES, ATTR_VALUE_SIZE, KERNEL_PARAMS

# CUDA_KERNEL_NODE_PARAMS_v2 as a numpy record (walk.KERNEL_PARAMS is the same layout as a struct).
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
_KERNEL_ARG = faults.active("kernel-arg")  # an injected fault (tests only)
_SKIP_KERNEL = faults.active("skip-kernel")  # an injected fault (tests only)
_KV_WRITE = faults.active("kv-write")  # an injected fault (tests only)
_OP_OF_TYPE = {
    int(NodeType.KERNEL): OP_KERNEL,
    int(NodeType.MEMSET): OP_MEMSET,
    int(NodeType.MEMCPY): OP_MEMCPY,
    int(NodeType.EMPTY): OP_EMPTY,
    int(NodeType.EVENT_RECORD): OP_RECORD,
    int(NodeType.WAIT_EVENT): OP_WAIT,
}


class AttrSets:
    """Attribute value buffers per attribute-set index of a table, shared by all nodes (and all
    graphs) using them: one per table, kept alive as long as the graphs prepared with it."""

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
    table: Any, i: int, functions: Functions, ctx: Any, attr_sets: AttrSets, *, row: int | None = None,
    corrupt: bool = False,
) -> PreparedGraph:
    """Like prepare(table.graph(i)) without materialising Python node objects (LOAD's hot path).
    `row`: a graph row of the table instead of root graph i (a union template). `corrupt`: an
    injected fault (`ember.runtime.faults`, kernel-arg / own-exec)."""
    row = int(table.roots[i]) if row is None else row
    types = np.asarray(table.node_types(row, row=True))
    if (types == int(NodeType.GRAPH)).any():
        return prepare(table.graph_of_row(row), functions, ctx)
    key = table.key_of_row(row)
    c = table.chunk_of_row(row)
    refs = np.asarray(c.refs)
    kmask = types == int(NodeType.KERNEL)
    krows = c.kpar[refs[kmask]]
    bpol = np.frombuffer(c.raw, dtype=np.uint8) if len(c.bpol) == 0 else c.bpol
    ptrs, slot_addr, has_params, is_extra = _argument_pointers(table, krows, np.uint64(bpol.ctypes.data))
    st = _kernel_structs(krows, functions, slot_addr, has_params, is_extra)
    fault = _corrupt(table, krows, ptrs, slot_addr, has_params, key) if corrupt or _KERNEL_ARG else None
    codes, args, objects = _node_ops(key, types, refs, kmask, st, c)
    attr_start, attr_count, attr_ids, attr_values = _attribute_ranges(krows, kmask, attr_sets)
    edges = table.edges(row, row=True)
    if _SKIP_KERNEL:
        _skip_a_kernel(codes, args, attr_count, kmask, edges)
    if _KV_WRITE:
        _skip_kv_writes(table, krows, codes, args, attr_count, kmask, edges, key)
    arrays = NodeArrays(codes, args, attr_start, attr_count, attr_ids, attr_values, objects)
    src, dst, data = _edges_by_destination(edges)
    return PreparedGraph(
        key=key,
        ops=[],
        edge_src=src,
        edge_dst=dst,
        edge_data=data,
        keepalive=[st, ptrs, c, bpol, fault],
        nodes=len(types),
        arrays=arrays,
    )


def in_union(template: PreparedGraph, member: PreparedGraph, slots: np.ndarray,
             placeholders: Sequence[int] = (), scratch: int = 0) -> PreparedGraph:
    """Member's nodes in their union slots, the template's in the others: the graph a union
    template exec is updated to for this member (ember.archive.union). Its edges are the
    template's chain; the member's nodes keep the buffers of `member` (kept alive with it). A
    memset slot among `placeholders` that the member lacks gets the template's memset writing
    to `scratch` instead: never disabled, it must write nothing the member uses."""
    u, m = template.arrays, member.arrays
    if u is None or m is None:
        raise RebuildError(f"graph {member.key}: a union member must be prepared from the table")
    codes, args = u.codes.copy(), u.args.copy()
    codes[slots], args[slots] = m.codes, m.args
    start, count = u.attr_start.copy(), u.attr_count.copy()
    start[slots] = m.attr_start + np.uint32(len(u.attr_ids))
    count[slots] = m.attr_count
    objects = {s: obj for s, obj in u.objects.items()}
    objects.update({int(slots[j]): obj for j, obj in m.objects.items()})
    lacking = np.setdiff1d(placeholders, slots).tolist()
    if lacking and not scratch:
        raise RebuildError(f"graph {member.key}: its union's placeholder memsets have no scratch")
    for s in lacking:
        mp = memset_struct(MemsetParams(scratch, 0, *_memset_shape(u.objects[s])))
        objects[s], args[s] = mp, int(mp.getPtr())
    arrays = NodeArrays(codes, args, start, count, np.concatenate([u.attr_ids, m.attr_ids]),
                        np.concatenate([u.attr_values, m.attr_values]), objects)
    return PreparedGraph(key=member.key, ops=[], edge_src=template.edge_src, edge_dst=template.edge_dst,
                         edge_data=template.edge_data, keepalive=[template, member], nodes=len(codes),
                         arrays=arrays)


def _corrupt(table: Any, krows: np.ndarray, ptrs: np.ndarray, slot_addr: np.ndarray,
             has_params: np.ndarray, key: tuple[int, ...]) -> list[np.ndarray]:
    first = (slot_addr - np.uint64(ptrs.ctypes.data)) // np.uint64(8)
    which = np.nonzero(has_params)[0]
    nodes = [(int(first[n]), table._layout(int(krows["layout"][n]))[1]) for n in which]
    kernels = getattr(table, "kernels", None)
    names = [kernels[int(krows["kernel"][n])].name for n in which] if kernels is not None else None
    return faults.corrupt_arguments(ptrs, nodes, names, graph=str(key))


def _skip_a_kernel(codes: np.ndarray, args: np.ndarray, attr_count: np.ndarray, kmask: np.ndarray,
                   e: np.ndarray) -> None:
    """The injected `skip-kernel` fault: one kernel node becomes an empty one (faults.kernel_to_skip)."""
    nondefault = (e["type"] != 0) | (e["from_port"] != 0) | (e["to_port"] != 0)
    j = faults.kernel_to_skip(np.nonzero(kmask)[0], e["src"], e["dst"], nondefault)
    if j is not None:
        codes[j], args[j], attr_count[j] = OP_EMPTY, 0, 0


def _skip_kv_writes(table: Any, krows: np.ndarray, codes: np.ndarray, args: np.ndarray,
                    attr_count: np.ndarray, kmask: np.ndarray, e: np.ndarray, key: Any) -> None:
    """The injected `kv-write` fault: the graph's KV cache writes become empty nodes."""
    kernels = getattr(table, "kernels", None)
    if kernels is None:
        return
    names = [kernels[int(k)].name for k in krows["kernel"]]
    nondefault = (e["type"] != 0) | (e["from_port"] != 0) | (e["to_port"] != 0)
    skipped = faults.kv_writes_to_skip(np.nonzero(kmask)[0], names, e["src"], e["dst"], nondefault)
    for j in skipped:
        codes[j], args[j], attr_count[j] = OP_EMPTY, 0, 0
    if skipped:
        faults.log.warning("fault: graph %s: %d KV cache write(s) left out", key, len(skipped))


def _memset_shape(mp: Any) -> tuple[int, int, int, int]:
    """(value, element size, width, height) of a CUDA_MEMSET_NODE_PARAMS."""
    return int(mp.value), int(mp.elementSize), int(mp.width), int(mp.height)


def _argument_pointers(
    table: Any, krows: np.ndarray, base: np.uint64
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One pointer arena for all kernel nodes: per node either a kernelParams array (one pointer
    per argument, into the chunk's byte pool at `base`) or an `extra` option list.

    Returns (arena, each node's slot address, has a kernelParams array, has an extra list)."""
    from ember.archive.graph_table import KPAR_EXTRA, NONE

    nk = len(krows)
    is_extra = (krows["flags"] & KPAR_EXTRA) != 0
    lay = krows["layout"].astype(np.int64)
    has_lay = (~is_extra) & (lay != NONE)
    layo = table._layo
    counts = np.zeros(nk, dtype=np.int64)
    counts[has_lay] = layo["count"][lay[has_lay]]
    slots = np.where(is_extra, EXTRA_SLOTS, counts)
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
        arg_offsets = table._lpar["offset"][lpar_idx].astype(np.uint64)
        ptrs[starts[node] + within] = base + args_off[node] + arg_offsets
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
    slot_addr = ptr_base + starts.astype(np.uint64) * np.uint64(8)
    return ptrs, slot_addr, has_lay & (counts > 0), is_extra


def _kernel_structs(
    krows: np.ndarray,
    functions: Functions,
    slot_addr: np.ndarray,
    has_params: np.ndarray,
    is_extra: np.ndarray,
) -> np.ndarray:
    """The CUDA_KERNEL_NODE_PARAMS of every kernel node, as one record array."""
    nk = len(krows)
    st = np.zeros(nk, dtype=_KP_DT)
    st["func"] = handles(functions, krows["kernel"]) if nk else 0
    for f in ("gx", "gy", "gz", "bx", "by", "bz", "smem"):
        st[f] = krows[f]
    st["kp"] = np.where(has_params, slot_addr, 0)
    st["extra"] = np.where(is_extra, slot_addr, 0)
    return st


def _node_ops(
    key: Any, types: np.ndarray, refs: np.ndarray, kmask: np.ndarray, st: np.ndarray, c: Any
) -> tuple[np.ndarray, np.ndarray, dict[int, Any]]:
    """Op code and argument per node (kernel: its struct's address; memset/memcpy: the address of
    a cuda.bindings struct kept in the returned objects; event: its index)."""
    n = len(types)
    codes = np.full(n, 255, dtype=np.uint8)
    for node_type, op in _OP_OF_TYPE.items():
        codes[types == node_type] = op
    if (codes == 255).any():
        bad = int(types[np.argmax(codes == 255)])
        raise RebuildError(f"graph {key}: node type {bad} cannot be rebuilt")
    args = np.zeros(n, dtype=np.uint64)
    nk = len(st)
    args[kmask] = np.uint64(st.ctypes.data) + np.arange(nk, dtype=np.uint64) * np.uint64(KERNEL_PARAMS.size)
    objects: dict[int, Any] = {}
    for j in np.nonzero(~kmask)[0].tolist():
        t, ref = int(types[j]), int(refs[j])
        if t == NodeType.MEMSET:
            dst, pitch, value, es, w, h = c.mset[ref].tolist()
            objects[j] = memset_struct(MemsetParams(dst, pitch, value, es, w, h))
        elif t == NodeType.MEMCPY:
            dst, src, nbytes = c.mcpy[ref].tolist()
            objects[j] = memcpy_struct(MemcpyParams(dst, src, nbytes))
        elif t in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            args[j] = ref  # the event index; build resolves it to this process's CUevent
        if j in objects:
            args[j] = int(objects[j].getPtr())
    return codes, args, objects


def _attribute_ranges(
    krows: np.ndarray, kmask: np.ndarray, attr_sets: AttrSets
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Kernel attributes: each distinct attribute set once, every kernel node a range into it.
    Returns (start, count) per node and the (id, value address) pairs they index."""
    n = len(kmask)
    attr_start = np.zeros(n, dtype=np.uint32)
    attr_count = np.zeros(n, dtype=np.uint32)
    ids: list[int] = []
    vals: list[int] = []
    if len(krows):
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
    return attr_start, attr_count, np.asarray(ids, dtype=np.uint32), np.asarray(vals, dtype=np.uint64)


def _edges_by_destination(e: np.ndarray) -> tuple[np.ndarray, np.ndarray, bytes | None]:
    """As prepare_graph.edges_by_destination, over the table's edge rows."""
    e = e[np.argsort(e["dst"], kind="stable")]
    src, dst = e["src"].astype(np.uint32), e["dst"].astype(np.uint32)
    data = None
    nondefault = (e["type"] != 0) | (e["from_port"] != 0) | (e["to_port"] != 0)
    if nondefault.any():
        packed = np.zeros((len(src), driver.EDGE_DATA_SIZE), dtype=np.uint8)
        packed[:, 0], packed[:, 1], packed[:, 2] = e["from_port"], e["to_port"], e["type"]
        data = packed.tobytes()
    return src, dst, data
