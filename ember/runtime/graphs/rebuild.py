"""LOAD side: `graphs.Graph` (or a decoded graph table's graph) → a new CUgraph, in two steps.

1. Prepare (CPU only, no driver calls; it can run on worker threads): every node's driver
   parameters packed into buffers the `PreparedGraph` keeps alive (`prepared`).
   - `prepare_graph.prepare`: from a `graphs.Graph` (in-process graph sets, child graphs);
   - `prepare_table.prepare_from_table`: vectorised, straight from the table's chunk (LOAD).
2. Build, on the thread that owns the driver (graph APIs contend across threads): add the
   nodes, set their attributes, add all edges with their edge data, read the edges back.
   - `build_native.build_native`: many graphs in one call to libember's builder;
   - `build_graph.build`: one graph from Python (what the native builder leaves), with the edge
     strategies (`EDGE_STRATEGIES`) a driver that drops edge data needs.

This module is the entry point callers import (`ember.runtime.graphs.templates`, SAVE's summary,
the benchmarks, the tests); it also re-applies per-function state and creates events.

Missing attributes are not cosmetic: a node that loses its cluster dimension dies with
CUDA_ERROR_ILLEGAL_INSTRUCTION, a sticky error that takes the process. So SAVE proves every
rebuilt graph before an archive is published (see ember.runtime.proof.prove).
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

from ember.archive.graphs import FunctionAttrs
from ember.runtime.graphs.build_graph import build, edge_strategy, instantiate
from ember.runtime.graphs.build_native import build_native
from ember.runtime.graphs.driver import OK, CudaError, check
from ember.runtime.graphs.prepare_graph import pack_arguments, prepare
from ember.runtime.graphs.prepare_table import AttrSets, prepare_from_table
from ember.runtime.graphs.prepared import EdgeDataLost, PreparedGraph, RebuildError

_FA = cu.CUfunction_attribute


def apply_function_attr(func: int, fa: FunctionAttrs) -> None:
    """Re-apply per-function state recorded at SAVE where the loaded function differs."""
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


__all__ = [
    "AttrSets",
    "EdgeDataLost",
    "PreparedGraph",
    "RebuildError",
    "apply_function_attr",
    "build",
    "build_native",
    "create_events",
    "edge_strategy",
    "instantiate",
    "pack_arguments",
    "prepare",
    "prepare_from_table",
]
