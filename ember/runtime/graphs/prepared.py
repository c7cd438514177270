"""A graph prepared for LOAD: every node's driver parameters packed, no driver call made yet.

Two forms of the same content, each derived from the other on demand:
- the op list (`PreparedGraph.ops`) the Python builder walks (`build_graph.build`): one tuple per
  node, `(OP_KERNEL, struct address, [(attribute id, value address)])`, `(OP_MEMSET, struct)`, ...;
- the node arrays (`NodeArrays`) libember's builder takes (`build_native.build_native`).

`prepare_graph.prepare` fills the op list from a `graphs.Graph`; `prepare_table.prepare_from_table`
fills the arrays straight from a decoded graph table's chunk (LOAD's hot path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Op codes of a prepared graph (`enum ember_op` of ember_build_graphs, native/include/ember.h).
OP_KERNEL, OP_MEMSET, OP_MEMCPY, OP_EMPTY, OP_RECORD, OP_WAIT, OP_CHILD = range(7)
# A collective placeholder: arg = index into the archive's collective table, resolved at build
# time to the rank's captured collective (`ember.runtime.comm.Splicer`), added as a child graph
# (libember's EMBER_OP_CHILD).
OP_SPLICE = 7


class RebuildError(RuntimeError):
    """A graph could not be rebuilt; names the graph key and node."""


class EdgeDataLost(RebuildError):
    """The driver accepted the edges but does not hold their edge data (read back)."""


@dataclass
class NodeArrays:
    """A graph's nodes as ember_build_graphs takes them (native/include/ember.h): an op code and an
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
        elif code in (OP_RECORD, OP_WAIT, OP_SPLICE):
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
        elif code in (OP_RECORD, OP_WAIT, OP_SPLICE):
            args[i] = op[1]
    attr_ids, attr_values = np.asarray(ids, dtype=np.uint32), np.asarray(vals, dtype=np.uint64)
    prep.arrays = NodeArrays(codes, args, start, count, attr_ids, attr_values, objects)
    return prep.arrays


def mark_splices(prep: PreparedGraph, pairs: list[tuple[int, int]]) -> None:
    """Turn the placeholder nodes of a prepared graph into OP_SPLICE (node index, table index)."""
    if prep.arrays is not None:
        for node, i in pairs:
            prep.arrays.codes[node] = OP_SPLICE
            prep.arrays.args[node] = i
            prep.arrays.objects.pop(node, None)
    if prep.ops:
        for node, i in pairs:
            prep.ops[node] = (OP_SPLICE, i)
