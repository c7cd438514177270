"""Thin helpers over cuda.bindings.driver shared by walk, the rebuild (prepare_*, build_*) and
the templates.

Only error checking and a few handles live here; the hot loops in `walk` and `build_graph` call
the driver directly and compare against `OK` inline to keep Python overhead per node low.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

OK = cu.CUresult.CUDA_SUCCESS


class CudaError(RuntimeError):
    """A driver call failed; carries the call name and the CUresult."""

    def __init__(self, what: str, err: Any) -> None:
        name = getattr(err, "name", str(err))
        super().__init__(f"{what} failed: {name}")
        self.what = what
        self.err = err


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising CudaError when it is not CUDA_SUCCESS."""
    if isinstance(result, tuple):
        if result[0] != OK:
            raise CudaError(what, result[0])
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]
    if result != OK:
        raise CudaError(what, result)
    return None


def current_context() -> Any:
    """The current CUcontext (PyTorch's primary context once torch has touched the device)."""
    ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        raise CudaError("cuCtxGetCurrent", "no current context: initialise CUDA first (torch.cuda.init())")
    return ctx


def graph_nodes(graph: Any) -> list[Any]:
    n = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    if not n:
        return []
    nodes, _ = check(cu.cuGraphGetNodes(graph, n), "cuGraphGetNodes")
    return list(nodes[:n])


def torch_stream_handle(stream: Any = None) -> Any:
    """A CUstream for a torch stream (the current one when None); a CUstream as it is."""
    if isinstance(stream, cu.CUstream):
        return stream
    import torch

    s = stream if stream is not None else torch.cuda.current_stream()
    return cu.CUstream(s.cuda_stream)


def launch_exec(ex: Any, stream: Any = None, what: str = "cuGraphLaunch") -> None:
    """Launch a graph exec on `stream` (a torch stream, a CUstream, or the current torch stream)."""
    r = cu.cuGraphLaunch(ex, torch_stream_handle(stream))
    if r[0] != OK:
        raise CudaError(what, r[0])


# ---- edges, read without cuda.bindings ----------------------------------------------------------
# cuda.bindings' cuGraphGetEdges (13.x) returns CUgraphEdgeData objects that point into an array
# it has already freed, so the edge data it hands back is whatever reuses that memory. Edges are
# read here through the driver's C entry point into buffers we own.
_GET_EDGES: Any = None


def _get_edges_fn() -> Any:
    global _GET_EDGES
    if _GET_EDGES is None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuGraphGetEdges_v2", None) or lib.cuGraphGetEdges
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
        ]
        fn.restype = ctypes.c_int
        _GET_EDGES = fn
    return _GET_EDGES


def graph_edges(graph: Any) -> tuple[list[int], list[int], bytes]:
    """(from node handles, to node handles, 8 bytes of CUgraphEdgeData per edge) of a CUgraph."""
    import ctypes

    fn = _get_edges_fn()
    handle = int(graph)
    n = ctypes.c_size_t(0)
    rc = fn(handle, None, None, None, ctypes.byref(n))
    if rc != 0:
        raise CudaError("cuGraphGetEdges (count)", rc)
    count = n.value
    if count == 0:
        return [], [], b""
    frm = (ctypes.c_uint64 * count)()
    to = (ctypes.c_uint64 * count)()
    data = (ctypes.c_uint8 * (8 * count))()
    rc = fn(handle, frm, to, data, ctypes.byref(n))
    if rc != 0:
        raise CudaError("cuGraphGetEdges", rc)
    count = min(count, n.value)
    return list(frm[:count]), list(to[:count]), bytes(data[: 8 * count])


# ---- edges, written without cuda.bindings ------------------------------------------------------
# Adding dependencies with edge data through cuda.bindings 13.x lost every programmatic edge (the
# rebuilt graphs read back with default edges only), so edges are written here as well, through
# cuGraphAddDependencies_v2 (the entry point that takes CUgraphEdgeData) with arrays we own.
_ADD_DEPS: Any = None
EDGE_DATA_SIZE = 8  # sizeof(CUgraphEdgeData): from_port, to_port, type, reserved[5]


def _add_deps_fn() -> Any:
    global _ADD_DEPS
    if _ADD_DEPS is None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuGraphAddDependencies_v2", None)
        if fn is None:
            raise CudaError("cuGraphAddDependencies_v2", "this driver has no edge-data entry point (< 12.3)")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_int
        _ADD_DEPS = fn
    return _ADD_DEPS


def pack_edge_data(edges: list[tuple[int, int, int]]) -> bytes:
    """CUgraphEdgeData array for (from_port, to_port, type) triples (reserved bytes zero)."""
    out = bytearray(EDGE_DATA_SIZE * len(edges))
    for j, (from_port, to_port, etype) in enumerate(edges):
        for v in (from_port, to_port, etype):
            if not 0 <= v <= 255:
                raise ValueError(f"edge {j}: edge data field {v} does not fit in a byte")
        out[EDGE_DATA_SIZE * j : EDGE_DATA_SIZE * j + 3] = bytes((from_port, to_port, etype))
    return bytes(out)


def add_dependencies(graph: Any, frm: list[int], to: list[int], data: bytes | None) -> None:
    """Add edges frm[j] → to[j] (node handles as ints) with their edge data (None = all default)."""
    import ctypes

    count = len(frm)
    if count != len(to) or (data is not None and len(data) != EDGE_DATA_SIZE * count):
        raise ValueError("edge arrays differ in length")
    if count == 0:
        return
    a = (ctypes.c_uint64 * count)(*frm)
    b = (ctypes.c_uint64 * count)(*to)
    d = (ctypes.c_uint8 * len(data)).from_buffer_copy(data) if data is not None else None
    rc = _add_deps_fn()(int(graph), a, b, d, count)
    if rc != 0:
        raise CudaError("cuGraphAddDependencies_v2", rc)


# ---- kernel nodes, added without cuda.bindings -------------------------------------------------
_KERNEL_NODE_FNS: Any = None


def kernel_node_fns() -> tuple[Any, Any]:
    """(cuGraphAddKernelNode_v2, cuGraphKernelNodeSetAttribute) as ctypes functions taking plain
    addresses: (node out, graph, deps, n deps, params struct) and (node, attribute id, value)."""
    global _KERNEL_NODE_FNS
    if _KERNEL_NODE_FNS is None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        add = lib.cuGraphAddKernelNode_v2
        add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        add.restype = ctypes.c_int
        set_attr = lib.cuGraphKernelNodeSetAttribute
        set_attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        set_attr.restype = ctypes.c_int
        _KERNEL_NODE_FNS = (add, set_attr)
    return _KERNEL_NODE_FNS
