"""Reading a graph table's union templates (format 1.1; ember/archive/union.py says what they
are): the UNIO/UMEM/USLT sections turned into `UnionInfo`s and checked, and each member checked
against its slots. `GraphTable.unions` and `GraphTable.check_union_member` call these.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.archive.graphs import NodeType
from ember.archive.table_layout import FormatError
from ember.archive.union import PLACEHOLDER_BYTES

_KERNEL, _MEMSET = int(NodeType.KERNEL), int(NodeType.MEMSET)


@dataclass(frozen=True)
class UnionInfo:
    """A union template (ember.archive.union) as the table holds it."""

    index: int
    row: int  # GRPH row of the template graph
    members: tuple[int, ...]  # root graph indices, in root order
    slots: tuple[np.ndarray, ...]  # per member: the template slot of each of its nodes
    nodes: int  # the template's node count
    optional: np.ndarray  # slots some member lacks
    placeholders: np.ndarray  # the memsets among them (a member that lacks one runs a placeholder)
    scratch_bytes: int  # what the largest placeholder writes


def read_unions(table: Any, unio: np.ndarray, umem: np.ndarray, uslt: np.ndarray) -> list[UnionInfo]:
    """The union templates and their members, checked: each member's slots rise strictly, lie in
    the template and hold nodes of the member's types, and only kernel slots and 1-D memsets of at
    most PLACEHOLDER_BYTES are optional (ember.archive.union: a member that lacks a memset runs a
    placeholder into scratch); FormatError otherwise."""
    if not len(unio):
        return []
    rows = unio["graph"].astype(np.int64)
    if (rows >= len(table.rows)).any() or not all(table.is_union_row(int(r)) for r in rows):
        raise FormatError("graph table index: a union names a graph row that is not a union template")
    if len(umem) != table.count:
        raise FormatError(f"graph table index: {len(umem)} union entries for {table.count} graphs")
    members: list[list[tuple[int, np.ndarray]]] = [[] for _ in rows]
    checked: dict[tuple[int, int, int], np.ndarray] = {}  # members of one topology share a run
    for i, (u, off) in enumerate(umem.tolist()):
        if u >= len(rows):
            raise FormatError(f"graph {table.keys[i]}: in union {u}, the table has {len(rows)}")
        if u >= 0:
            seg = (u, off, int(table.rows[int(table.roots[i])]["ntyp_off"]))
            if seg not in checked:
                checked[seg] = _slots(table, uslt, i, int(rows[u]), off)
            members[u].append((i, checked[seg]))
    out = []
    for u, row in enumerate(rows.tolist()):
        uses = np.zeros(int(table.rows[row]["node_count"]), dtype=np.int64)  # members per slot
        runs, counts = {id(r): r for _, r in members[u]}, Counter(id(r) for _, r in members[u])
        for key, run in runs.items():
            uses[run] += counts[key]
        optional = np.nonzero(uses < len(members[u]))[0]
        types = table.node_types(row, row=True)[optional]
        if ((types != _KERNEL) & (types != _MEMSET)).any():
            raise FormatError(f"graph table index: union {u} leaves a memcpy node out of a member")
        placeholders = optional[types == _MEMSET]
        out.append(UnionInfo(u, row, tuple(i for i, _ in members[u]), tuple(r for _, r in members[u]),
                             len(uses), optional, placeholders, _scratch_bytes(table, u, row, placeholders)))
    return out


def _scratch_bytes(table: Any, u: int, row: int, placeholders: np.ndarray) -> int:
    """What the largest of union u's placeholder memsets writes; FormatError unless every one is
    1-D and writes at most PLACEHOLDER_BYTES (exec update cannot change a memset's dimensions)."""
    if not len(placeholders):
        return 0
    c = table.chunk_of_row(row)
    ms = c.mset[c.refs[placeholders]]
    nbytes = ms["width"].astype(np.int64) * ms["element_size"].astype(np.int64)
    if (ms["height"] > 1).any() or (nbytes > PLACEHOLDER_BYTES).any() or (nbytes <= 0).any():
        raise FormatError(f"graph table index: union {u} leaves a memset out of a member that no "
                          f"placeholder can stand in for (2-D, empty or over {PLACEHOLDER_BYTES} bytes)")
    return int(nbytes.max())


def _slots(table: Any, uslt: np.ndarray, i: int, urow: int, off: int) -> np.ndarray:
    """Graph i's slots in the union template at row `urow`, checked."""
    n = int(table.rows[int(table.roots[i])]["node_count"])
    run = uslt[off:off + n]
    within = len(run) == n and (n == 0 or int(run[-1]) < int(table.rows[urow]["node_count"]))
    if not within or (np.diff(run.astype(np.int64)) <= 0).any():
        raise FormatError(f"graph {table.keys[i]}: its union slots are out of range or out of order")
    if not np.array_equal(table.node_types(urow, row=True)[run], table.node_types(i)):
        raise FormatError(f"graph {table.keys[i]}: its node types differ from its union slots'")
    return run


def check_member(table: Any, u: UnionInfo, m: int) -> None:
    """FormatError unless member m of union u (a root index) matches the template's nodes in its
    slots in everything exec update cannot change: launch attributes and function cluster
    requirements of kernels, element size and shape of memsets (`topology.node_class`)."""
    i = u.members[m]
    slots, types = u.slots[m], table.node_types(i)
    a, b = table.chunk_of_row(u.row), table.chunk(i)
    fatr = table._fatr[["cluster_x", "cluster_y", "cluster_z", "non_portable_cluster"]]
    k = np.nonzero(types == _KERNEL)[0]
    ka, kb = a.kpar[a.refs[slots[k]]], b.kpar[b.refs[k]]
    same = (ka["attrs"] == kb["attrs"]) & (fatr[ka["kernel"]] == fatr[kb["kernel"]])
    ms = np.nonzero(types == _MEMSET)[0]
    sa, sb = a.mset[a.refs[slots[ms]]], b.mset[b.refs[ms]]
    same_ms = (sa["element_size"] == sb["element_size"]) & ((sa["height"] > 1) == (sb["height"] > 1))
    bad = np.concatenate([k[~same], ms[~same_ms]])
    if len(bad):
        raise FormatError(f"graph {table.keys[i]}: node {int(bad.min())} does not match its union slot "
                          "(attributes, cluster requirement or memset shape): damaged archive")
