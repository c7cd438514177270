"""Thin helpers over cuda.bindings.driver shared by walk, rebuild and the graph library.

Only error checking and a few handles live here; the hot loops in `walk` and `rebuild` call the
driver directly and compare against `OK` inline to keep Python overhead per node low.
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
    """A CUstream for a torch stream (the current one when None)."""
    import torch

    s = stream if stream is not None else torch.cuda.current_stream()
    return cu.CUstream(s.cuda_stream)
