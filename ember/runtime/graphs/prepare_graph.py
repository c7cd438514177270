"""Prepare a `graphs.Graph` for LOAD: the CPU half of rebuilding it, no driver calls (thread-safe).

Per kernel node a CUDA_KERNEL_NODE_PARAMS struct is packed (function handle, dims, a kernelParams
pointer array into one argument buffer, or the `extra` option list around the opaque blob) and
its non-default attribute values, all in buffers the PreparedGraph keeps alive. Memset and memcpy
nodes get their cuda.bindings structs; events stay indices (the builder resolves them).

This is the path for Graph objects (in-process graph sets, child graphs, tests). LOAD prepares
from the decoded graph table without Python node objects (`prepare_table`), with the same result.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from cuda.bindings import driver as cu

from ember.archive.graphs import (
    Edge,
    EventParams,
    Graph,
    KernelParams,
    MemcpyParams,
    MemsetParams,
    NodeType,
)
from ember.runtime.graphs import driver
from ember.runtime.graphs.kernels import Functions
from ember.runtime.graphs.prepared import (
    OP_CHILD,
    OP_EMPTY,
    OP_KERNEL,
    OP_MEMCPY,
    OP_MEMSET,
    OP_RECORD,
    OP_WAIT,
    PreparedGraph,
    RebuildError,
)
from ember.runtime.graphs.walk import ATTR_SIZES, ATTR_VALUE_SIZE, KERNEL_PARAMS

EXTRA_SLOTS = 6  # {BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END} and the size word itself


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


def memset_struct(m: MemsetParams) -> Any:
    mp = cu.CUDA_MEMSET_NODE_PARAMS()
    mp.dst, mp.pitch, mp.value = m.dst, m.pitch, m.value
    mp.elementSize, mp.width, mp.height = m.element_size, m.width, m.height
    return mp


def memcpy_struct(c: MemcpyParams) -> Any:
    cp = cu.CUDA_MEMCPY3D()
    cp.srcMemoryType = cp.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    cp.srcDevice, cp.dstDevice = c.src, c.dst
    cp.WidthInBytes, cp.Height, cp.Depth = c.size, 1, 1
    return cp


class KernelBuffers:
    """The kernel nodes of one graph packed side by side: one struct array, one argument arena,
    one pointer arena, one attribute-value buffer, each sized once from the graph's kernels."""

    def __init__(self, kernels: list[KernelParams]) -> None:
        self.structs = np.zeros(len(kernels) * KERNEL_PARAMS.size, dtype=np.uint8)
        arena_len = sum(len(p.extra) if p.extra is not None else len(p.args) for p in kernels)
        self.arena = np.zeros(max(arena_len, 8), dtype=np.uint8)
        n_ptrs = sum(len(p.arg_offsets) if p.extra is None else EXTRA_SLOTS for p in kernels)
        self.ptrs = np.zeros(max(n_ptrs, 1), dtype=np.uint64)
        attr_buf_len = sum(len(p.attrs) for p in kernels) * ATTR_VALUE_SIZE
        self.attr_buf = np.zeros(max(attr_buf_len, 8), dtype=np.uint8)
        self.arena_base, self.ptr_base = self.arena.ctypes.data, self.ptrs.ctypes.data
        self.struct_base, self.attr_base = self.structs.ctypes.data, self.attr_buf.ctypes.data
        # writable views: slice assignment from bytes without a numpy conversion
        self.structs_mv, self.arena_mv, self.attr_mv = self.structs.data, self.arena.data, self.attr_buf.data
        self.a_off = self.p_off = self.k = self.at_off = 0

    def keepalive(self) -> list[Any]:
        return [self.structs, self.arena, self.ptrs, self.attr_buf]

    def add(self, key: tuple[int, ...], idx: int, p: KernelParams, func: int) -> tuple[Any, ...]:
        """Pack kernel node `idx` of graph `key`; returns its op
        (OP_KERNEL, struct address, [(attribute id, value address)])."""
        blob, offsets = pack_arguments(p)
        a_off, p_off = self.a_off, self.p_off
        self.arena_mv[a_off : a_off + len(blob)] = blob
        kparams = extra = 0
        if p.extra is not None:
            # {BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END}; the size word sits in slot 5.
            size_slot = self.ptr_base + (p_off + 5) * 8
            self.ptrs[p_off : p_off + EXTRA_SLOTS] = (1, self.arena_base + a_off, 2, size_slot, 0, len(blob))
            extra = self.ptr_base + p_off * 8
            p_off += EXTRA_SLOTS
        elif offsets:
            n = len(offsets)
            args_at = np.uint64(self.arena_base + a_off)
            self.ptrs[p_off : p_off + n] = np.asarray(offsets, dtype=np.uint64) + args_at
            kparams = self.ptr_base + p_off * 8
            p_off += n
        self.a_off, self.p_off = a_off + len(blob), p_off
        gx, gy, gz = p.grid
        bx, by, bz = p.block
        so = self.k * KERNEL_PARAMS.size
        KERNEL_PARAMS.pack_into(
            self.structs_mv, so, func, gx, gy, gz, bx, by, bz, p.shared_mem, kparams, extra, 0, 0
        )
        self.k += 1
        return (OP_KERNEL, self.struct_base + so, self._attrs(key, idx, p))

    def _attrs(self, key: tuple[int, ...], idx: int, p: KernelParams) -> list[tuple[int, int]]:
        attrs: list[tuple[int, int]] = []
        for a, raw in p.attrs.items():
            if a not in ATTR_SIZES:
                continue  # launch-only attributes never go on a node (see walk.ATTR_SIZES)
            if len(raw) != ATTR_VALUE_SIZE:
                raise RebuildError(f"graph {key}: node {idx}: attribute {a} has {len(raw)} bytes")
            at_off = self.at_off
            self.attr_mv[at_off : at_off + ATTR_VALUE_SIZE] = raw
            attrs.append((a, self.attr_base + at_off))
            self.at_off = at_off + ATTR_VALUE_SIZE
        return attrs


def prepare(graph: Graph, functions: Functions, ctx: Any, memset_ctx: Any = None) -> PreparedGraph:
    """CPU-only preparation of one graph (no driver calls; thread-safe)."""
    buffers = KernelBuffers([cast(KernelParams, n.params) for n in graph.nodes if n.type == NodeType.KERNEL])
    ops: list[tuple[Any, ...]] = []
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
            ops.append(buffers.add(graph.key, idx, p, func))
        elif t == NodeType.MEMSET:
            ops.append((OP_MEMSET, memset_struct(node.params)))  # type: ignore[arg-type]
        elif t == NodeType.MEMCPY:
            ops.append((OP_MEMCPY, memcpy_struct(node.params)))  # type: ignore[arg-type]
        elif t == NodeType.EMPTY:
            ops.append((OP_EMPTY,))
        elif t in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            e: EventParams = node.params  # type: ignore[assignment]
            ops.append((OP_RECORD if t == NodeType.EVENT_RECORD else OP_WAIT, e.event))
        elif t == NodeType.GRAPH:
            ops.append((OP_CHILD, prepare(node.params, functions, ctx)))  # type: ignore[arg-type]
        else:
            raise RebuildError(f"graph {graph.key}: node {idx}: node type {t.name} cannot be rebuilt")
    src, dst, data = edges_by_destination(graph.edges)
    return PreparedGraph(
        key=graph.key,
        ops=ops,
        edge_src=src,
        edge_dst=dst,
        edge_data=data,
        keepalive=buffers.keepalive(),
        nodes=len(graph.nodes),
    )


def edges_by_destination(edges: list[Edge]) -> tuple[list[int], list[int], bytes | None]:
    """Edges grouped by destination (stable): each node's dependencies in capture order, as
    stream capture created them; the same order for every graph of a group (exec update).
    Edge data only when some edge is not a default one."""
    ordered = sorted(edges, key=lambda e: e.dst)
    data = None
    if any(e.type or e.from_port or e.to_port for e in ordered):
        data = driver.pack_edge_data([(e.from_port, e.to_port, e.type) for e in ordered])
    return [e.src for e in ordered], [e.dst for e in ordered], data
