"""SAVE side: walk live CUDA graphs (cuda.bindings.driver) into the CUDA-free `graphs` model.

Every node type an engine's decode graph produces is recorded exactly: kernel (function as a
catalog KernelRef, launch dims, shared memory, argument bytes laid out by cuFuncGetParamInfo or
the opaque `extra` blob as is, every kernel node attribute that differs from the driver's
default), memset, 1-D device-to-device memcpy, event record/wait (events numbered per graph
set), empty and child graphs (recursively); edges keep their edge data (programmatic dependent
launch). Anything that cannot be restored exactly raises `WalkRefused` naming the graph key,
the node index and the reason. Per-function state (max dynamic shared memory, cluster
requirements, carveout) is recorded once per kernel as FunctionAttrs.

Usage:
    walker = GraphWalker(resolver)
    g = walker.walk(torch_graph.raw_cuda_graph(), key=(8,))
    graph_set = walker.graph_set([g, ...])
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from cuda.bindings import driver as cu

from ember.archive.graphs import (
    Edge,
    EventParams,
    FunctionAttrs,
    Graph,
    GraphSet,
    KernelParams,
    KernelRef,
    MemcpyParams,
    MemsetParams,
    Node,
    NodeType,
)
from ember.runtime.graphs.driver import OK, CudaError, check, graph_edges, graph_nodes
from ember.runtime.graphs.kernels import KernelNotFound, KernelResolver
from ember.runtime.proof.structure import external_waits

# CUDA_KERNEL_NODE_PARAMS_v2: func, grid xyz, block xyz, smem, (pad), kernelParams, extra, kern, ctx.
KERNEL_PARAMS = struct.Struct("<Q3I3II4xQQQQ")
ATTR_VALUE_SIZE = 64  # sizeof(CUlaunchAttributeValue): records are zero-padded to it
# Kernel NODE attributes (CUlaunchAttributeID → bytes of its member of the value union). Only
# these bytes are read: the rest of the 64-byte union is whatever the buffer held.
# Launch-only attributes are deliberately absent: PROGRAMMATIC_STREAM_SERIALIZATION (6),
# PROGRAMMATIC_EVENT (7) and LAUNCH_COMPLETION_EVENT (12). A captured graph carries programmatic
# dependent launch in its EDGE DATA; setting 6 on a rebuilt node would change what its other
# (default) dependencies mean. DEVICE_UPDATABLE_KERNEL_NODE (13) is checked, never copied.
ATTR_SIZES: dict[int, int] = {
    1: 28,  # access policy window {base_ptr, num_bytes, hitRatio, hitProp, missProp}
    2: 4,  # cooperative
    3: 4,  # synchronization policy
    4: 12,  # cluster dimension {x, y, z}
    5: 4,  # cluster scheduling policy preference
    8: 4,  # priority
    9: 2,  # mem-sync domain map {default_, remote}
    10: 4,  # mem-sync domain
    11: 12,  # preferred cluster dimension
    14: 4,  # preferred shared memory carveout
    16: 4,  # NVLink-utilisation-centric scheduling
    17: 4,  # portable cluster size mode
    18: 4,  # shared memory mode
}
_ATTR_ENUM = {int(a): a for a in cu.CUkernelNodeAttrID}
NODE_ATTRS: tuple[int, ...] = tuple(a for a in ATTR_SIZES if a in _ATTR_ENUM)
DEVICE_UPDATABLE = 13

CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2

_FA = cu.CUfunction_attribute
_U64 = ctypes.c_uint64
_U32 = ctypes.c_uint32


def _attr_bytes(value: Any, attr: int) -> bytes:
    """The attribute's own bytes of a CUlaunchAttributeValue, zero-padded to the union's size."""
    n = ATTR_SIZES[attr]
    return ctypes.string_at(value.getPtr(), n) + bytes(ATTR_VALUE_SIZE - n)


_T_KERNEL = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL


class WalkRefused(Exception):
    """A graph holds something SAVE cannot restore exactly; the archive must not be made."""

    def __init__(self, key: tuple[int, ...], node: int, reason: str) -> None:
        super().__init__(f"graph {key}: node {node}: {reason}")
        self.key, self.node, self.reason = key, node, reason


class KernelUnnamed(WalkRefused):
    """A kernel node whose function the resolver cannot name (the graph itself may be fine)."""


class GraphWalker:
    """Walks graphs one by one, sharing the kernel, function-attribute and event tables."""

    def __init__(self, resolver: KernelResolver) -> None:
        self.resolver = resolver
        self.kernels: list[KernelRef] = []
        self.function_attrs: list[FunctionAttrs] = []
        self._kernel_index: dict[KernelRef, int] = {}
        self._by_handle: dict[tuple[int, int], int] = {}
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._events: dict[int, int] = {}
        self._attr_defaults: dict[int, bytes] | None = None
        self._memtype_cache: dict[int, bool] = {}
        self.stats = {"kernel": 0, "extra": 0, "attrs": 0, "nodes": 0, "programmatic_edges": 0}

    # ---- public -------------------------------------------------------------------------
    def walk(self, handle: Any, key: tuple[int, ...]) -> Graph:
        """Walk one CUgraph (a CUgraph, or an int handle as torch's raw_cuda_graph() returns)."""
        graph = handle if isinstance(handle, cu.CUgraph) else cu.CUgraph(int(handle))
        walked = self._walk(graph, tuple(key))
        for where, ev in external_waits(walked):
            # a restored graph waits on a fresh event nothing records: the ordering would vanish
            raise WalkRefused(tuple(key), -1, f"{where}: waits on event {ev}, recorded outside the graph")
        return walked

    def graph_set(self, graphs: list[Graph]) -> GraphSet:
        return GraphSet(graphs=graphs, kernels=list(self.kernels), function_attrs=list(self.function_attrs))

    @property
    def event_count(self) -> int:
        return len(self._events)

    # ---- graph level --------------------------------------------------------------------
    def _walk(self, graph: Any, key: tuple[int, ...]) -> Graph:
        nodes = graph_nodes(graph)
        index = {int(n): i for i, n in enumerate(nodes)}
        out: list[Node] = []
        kernel_type = _T_KERNEL
        for i, node in enumerate(nodes):
            err, ntype = cu.cuGraphNodeGetType(node)
            if err != OK:
                raise WalkRefused(key, i, f"cuGraphNodeGetType failed: {err}")
            if ntype == kernel_type:
                out.append(Node(NodeType.KERNEL, self._kernel(node, key, i)))
            else:
                out.append(self._other(node, int(ntype), key, i))
        self.stats["nodes"] += len(nodes)
        return Graph(key=key, nodes=out, edges=self._edges(graph, index, key))

    def _edges(self, graph: Any, index: dict[int, int], key: tuple[int, ...]) -> list[Edge]:
        try:
            frm, to, data = graph_edges(graph)  # edge data in our own buffer (see driver.graph_edges)
        except CudaError as exc:
            raise WalkRefused(key, -1, f"reading edges failed: {exc}") from None
        edges = []
        for j, (a, b) in enumerate(zip(frm, to, strict=True)):
            from_port, to_port, etype = data[8 * j], data[8 * j + 1], data[8 * j + 2]
            if from_port or to_port or etype:
                edges.append(Edge(index[a], index[b], from_port, to_port, etype))
                self.stats["programmatic_edges"] += etype == 1
            else:
                edges.append(Edge(index[a], index[b]))
        return edges

    # ---- kernel nodes -------------------------------------------------------------------
    def _kernel(self, node: Any, key: tuple[int, ...], i: int) -> KernelParams:
        err, p = cu.cuGraphKernelNodeGetParams(node)
        if err != OK:
            raise WalkRefused(key, i, f"cuGraphKernelNodeGetParams failed: {err}")
        (func, gx, gy, gz, bx, by, bz, smem, kparams, extra, kern, _ctx) = KERNEL_PARAMS.unpack(
            ctypes.string_at(p.getPtr(), KERNEL_PARAMS.size)
        )
        kidx = self._by_handle.get((func, kern))
        if kidx is None:
            kidx = self._add_kernel(func, kern, key, i)
        self.stats["kernel"] += 1
        kp = KernelParams(kernel=kidx, grid=(gx, gy, gz), block=(bx, by, bz), shared_mem=smem)
        if kparams:
            offsets, sizes = self._layouts[kidx]
            if offsets:
                ptrs = (_U64 * len(offsets)).from_address(kparams)
                buf = bytearray(offsets[-1] + sizes[-1])
                for j, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
                    buf[off : off + size] = ctypes.string_at(ptrs[j], size)
                kp.args = bytes(buf)
                kp.arg_offsets, kp.arg_sizes = offsets, sizes
        elif extra:
            kp.extra = self._extra_blob(extra, key, i)
            self.stats["extra"] += 1
        elif self._layouts[kidx][0]:
            raise WalkRefused(key, i, "kernel node has arguments but neither kernelParams nor extra")
        kp.attrs = self._attributes(node, key, i)
        return kp

    def _add_kernel(self, func: int, kern: int, key: tuple[int, ...], i: int) -> int:
        if not func:
            if not kern:
                raise WalkRefused(key, i, "kernel node without a function")
            func = int(check(cu.cuKernelGetFunction(cu.CUkernel(kern)), "cuKernelGetFunction"))
        try:
            ref = self.resolver.lookup(func, kern)
        except KernelNotFound as exc:
            raise KernelUnnamed(key, i, str(exc)) from None
        kidx = self._kernel_index.get(ref)
        if kidx is None:
            kidx = len(self.kernels)
            self.kernels.append(ref)
            self._kernel_index[ref] = kidx
            self.function_attrs.append(self._function_attrs(func))
            self._layouts[kidx] = self._param_layout(func)
        self._by_handle[(func, kern)] = kidx
        return kidx

    @staticmethod
    def _param_layout(func: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        f = cu.CUfunction(func)
        offsets: list[int] = []
        sizes: list[int] = []
        while True:
            err, off, size = cu.cuFuncGetParamInfo(f, len(offsets))
            if err != OK:
                break
            offsets.append(off)
            sizes.append(size)
        return tuple(offsets), tuple(sizes)

    @staticmethod
    def _function_attrs(func: int) -> FunctionAttrs:
        f = cu.CUfunction(func)

        def get(attr: Any, default: int) -> int:
            err, v = cu.cuFuncGetAttribute(attr, f)
            return int(v) if err == OK else default

        return FunctionAttrs(
            max_dynamic_shared=get(_FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 0),
            required_cluster=(
                get(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, 0),
                get(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT, 0),
                get(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH, 0),
            ),
            non_portable_cluster=get(_FA.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 0),
            carveout=get(_FA.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, -1),
        )

    @staticmethod
    def _extra_blob(extra: int, key: tuple[int, ...], i: int) -> bytes:
        words = (_U64 * 16).from_address(extra)
        ptr = size = None
        for k in range(0, 16, 2):
            tag = words[k]
            if tag == CU_LAUNCH_PARAM_END:
                break
            if tag == CU_LAUNCH_PARAM_BUFFER_POINTER:
                ptr = words[k + 1]
            elif tag == CU_LAUNCH_PARAM_BUFFER_SIZE:
                size = _U64.from_address(words[k + 1]).value
            else:
                raise WalkRefused(key, i, f"unknown launch `extra` option {tag:#x}")
        if ptr is None or size is None:
            raise WalkRefused(key, i, "launch `extra` without a buffer pointer and size")
        return ctypes.string_at(ptr, size)

    def _attributes(self, node: Any, key: tuple[int, ...], i: int) -> dict[int, bytes]:
        defaults = self._attr_defaults
        if defaults is None:
            defaults = self._attr_defaults = self._default_attributes(node)
        attrs: dict[int, bytes] = {}
        for a in NODE_ATTRS:
            err, v = cu.cuGraphKernelNodeGetAttribute(node, _ATTR_ENUM[a])
            if err != OK:
                continue
            raw = _attr_bytes(v, a)
            if raw != defaults.get(a):
                attrs[a] = raw
        if DEVICE_UPDATABLE in _ATTR_ENUM:
            err, v = cu.cuGraphKernelNodeGetAttribute(node, _ATTR_ENUM[DEVICE_UPDATABLE])
            if err == OK and _U32.from_address(v.getPtr()).value:
                raise WalkRefused(key, i, "device-updatable kernel node (its device handle is process-local)")
        if attrs:
            self.stats["attrs"] += 1
        return attrs

    @staticmethod
    def _default_attributes(template: Any) -> dict[int, bytes]:
        """Attribute values of a fresh kernel node: what a rebuilt node starts with."""
        _err, p = cu.cuGraphKernelNodeGetParams(template)
        scratch = check(cu.cuGraphCreate(0), "cuGraphCreate")
        try:
            node = check(cu.cuGraphAddKernelNode(scratch, None, 0, p), "cuGraphAddKernelNode (scratch)")
            out = {}
            for a in NODE_ATTRS:
                e, v = cu.cuGraphKernelNodeGetAttribute(node, _ATTR_ENUM[a])
                if e == OK:
                    out[a] = _attr_bytes(v, a)
            return out
        finally:
            cu.cuGraphDestroy(scratch)

    # ---- other node types ---------------------------------------------------------------
    def _other(self, node: Any, ntype: int, key: tuple[int, ...], i: int) -> Node:
        t = NodeType(ntype) if ntype in NodeType._value2member_map_ else None
        if t is NodeType.MEMSET:
            p = check(cu.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
            return Node(t, MemsetParams(int(p.dst), p.pitch, p.value, p.elementSize, p.width, p.height))
        if t is NodeType.MEMCPY:
            return Node(t, self._memcpy(node, key, i))
        if t is NodeType.EMPTY:
            return Node(t)
        if t in (NodeType.EVENT_RECORD, NodeType.WAIT_EVENT):
            get = (
                cu.cuGraphEventRecordNodeGetEvent
                if t is NodeType.EVENT_RECORD
                else cu.cuGraphEventWaitNodeGetEvent
            )
            ev = int(check(get(node), "cuGraphEvent*NodeGetEvent"))
            return Node(t, EventParams(self._events.setdefault(ev, len(self._events))))
        if t is NodeType.GRAPH:
            child = check(cu.cuGraphChildGraphNodeGetGraph(node), "cuGraphChildGraphNodeGetGraph")
            return Node(t, self._walk(child, (*key, -1, i)))
        reasons = {
            NodeType.HOST: "host node (a CPU callback and its user data cannot be serialized)",
            NodeType.MEM_ALLOC: "memory-allocation node (CUDA chooses its address at instantiate)",
            NodeType.MEM_FREE: "memory-free node (pairs with an allocation node)",
            NodeType.CONDITIONAL: "conditional node (its handle and body are not restorable yet)",
            NodeType.EXT_SEMAS_SIGNAL: "external-semaphore node (process-local handle)",
            NodeType.EXT_SEMAS_WAIT: "external-semaphore node (process-local handle)",
            NodeType.BATCH_MEM_OP: "batch memory-operation node (not restorable yet)",
        }
        raise WalkRefused(key, i, reasons.get(t, f"unsupported node type {ntype}"))  # type: ignore[arg-type]

    def _memcpy(self, node: Any, key: tuple[int, ...], i: int) -> MemcpyParams:
        p = check(cu.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
        dev = (cu.CUmemorytype.CU_MEMORYTYPE_DEVICE, cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED)
        if p.srcMemoryType not in dev or p.dstMemoryType not in dev:
            raise WalkRefused(key, i, "memcpy node touching host memory or arrays (only device-to-device)")
        if (p.Height or 1) != 1 or (p.Depth or 1) != 1 or p.srcXInBytes or p.dstXInBytes or p.srcY or p.dstY:
            raise WalkRefused(key, i, "memcpy node that is not a plain 1-D copy")
        src, dst = int(p.srcDevice), int(p.dstDevice)
        for ptr in (src, dst):
            if not self._is_device(ptr):
                raise WalkRefused(key, i, f"memcpy node with a non-device pointer {ptr:#x}")
        return MemcpyParams(dst=dst, src=src, size=int(p.WidthInBytes))

    def _is_device(self, ptr: int) -> bool:
        err, mt = cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cu.CUdeviceptr(ptr)
        )
        return err == OK and int(mt) == int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE)
