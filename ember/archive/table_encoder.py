"""Encoding a `GraphSet` into a graph table (what SAVE writes): `encode`.

Graphs are encoded row by row (root graphs first, child graphs appended as their parents are met);
node types, edges, argument layouts, attribute sets and strings go to deduplicated pools in the
index, each graph's param rows to its own chunk, compressed against its group template's chunk.
The layout is ember/archive/table_layout.py.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import zstandard as zstd

from ember import settings
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
from ember.archive.table_layout import (
    ATTR_DT,
    DEFAULT_LEVEL,
    EDGE_DT,
    FATR_DT,
    GRAPH_IS_CHILD,
    GRAPH_IS_UNION,
    GRPH_DT,
    I64,
    KERN_DT,
    KPAR_DT,
    KPAR_EXTRA,
    LPAR_DT,
    MAGIC,
    MAJOR,
    MCPY_DT,
    MINOR,
    MSET_DT,
    NONE,
    OUTER,
    SERIALIZABLE,
    SPAN_DT,
    TOPO_DT,
    U32,
    UMEM_DT,
    UNIO_DT,
    FormatError,
    UnsupportedNode,
    pack_container,
)
from ember.archive.topology import TopologyGroup, group_graphs, group_index
from ember.archive.union import UnionGroup, union_groups

_WHY_NOT = {  # why a node type cannot be archived
    NodeType.HOST: "host nodes call a CPU function pointer with user data that cannot be saved",
    NodeType.MEM_ALLOC: "mem-alloc nodes get their address chosen by CUDA at instantiate",
    NodeType.MEM_FREE: "mem-free nodes pair with mem-alloc nodes, which cannot be restored",
    NodeType.EXT_SEMAS_SIGNAL: "external semaphores are process-local handles",
    NodeType.EXT_SEMAS_WAIT: "external semaphores are process-local handles",
    NodeType.BATCH_MEM_OP: "batch memory operations are not supported yet",
    NodeType.CONDITIONAL: "conditional nodes (handles, bodies) are not supported yet",
}


_Row = tuple[int, ...]


def _args_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Interner:
    """Content-deduplicating append-only pool of byte strings."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.seen: dict[bytes, int] = {}

    def add(self, data: bytes) -> tuple[int, int]:
        off = self.seen.get(data)
        if off is None:
            off = self.seen[data] = len(self.buf)
            self.buf += data
        return off, len(data)


class _Encoder:
    def __init__(self, gs: GraphSet) -> None:
        self.gs = gs
        self.rows: list[dict[str, Any]] = []
        self.chunks: list[bytes] = []
        self.keys: list[int] = []
        self.ntyp = _Interner()
        self.edges = bytearray()
        self.edge_seen: dict[bytes, int] = {}
        self.strs = _Interner()
        self.layouts: dict[tuple[tuple[int, int], ...], int] = {}
        self.lpar: list[tuple[int, int]] = []
        self.attr_sets: dict[tuple[tuple[int, bytes], ...], int] = {(): 0}
        self.atts: list[tuple[int, int]] = [(0, 0)]
        self.attr_rows: list[tuple[int, int, int]] = []
        self.aval = _Interner()
        self.pending: list[tuple[int, Graph, str]] = []
        self.lpar_spans: list[tuple[int, int]] = []

    def _layout(self, p: KernelParams) -> int:
        if p.extra is not None:
            return NONE
        pairs = tuple(zip(p.arg_offsets, p.arg_sizes, strict=True))
        idx = self.layouts.get(pairs)
        if idx is None:
            idx = self.layouts[pairs] = len(self.lpar_spans)
            self.lpar_spans.append((len(self.lpar), len(pairs)))
            self.lpar.extend(pairs)
        return idx

    def _attrs(self, attrs: dict[int, bytes]) -> int:
        if not attrs:
            return 0
        key = tuple(sorted(attrs.items()))
        idx = self.attr_sets.get(key)
        if idx is None:
            idx = self.attr_sets[key] = len(self.atts)
            self.atts.append((len(self.attr_rows), len(key)))
            for attr_id, value in key:
                off, n = self.aval.add(bytes(value))
                self.attr_rows.append((attr_id, off, n))
        return idx

    def add_graph(self, graph: Graph, where: str, child: bool) -> int:
        row = len(self.rows)
        self.rows.append({})
        self.pending.append((row, graph, where))
        self.rows[row]["flags"] = GRAPH_IS_CHILD if child else 0
        return row

    def encode_graph(self, row: int, graph: Graph, where: str) -> None:
        """Row `row`'s chunk (its param tables), key, node types and edges."""
        types, refs, kpar, bpol, mset, mcpy = self._param_rows(graph, where)
        try:
            chunk = pack_container({
                b"REFS": refs,
                b"KPAR": np.array(kpar, dtype=KPAR_DT),
                b"BPOL": bpol,
                b"MSET": np.array(mset, dtype=MSET_DT),
                b"MCPY": np.array(mcpy, dtype=MCPY_DT),
            })
            edge_arr = np.array([(e.src, e.dst, e.from_port, e.to_port, e.type, 0) for e in graph.edges],
                                dtype=EDGE_DT)
            key = np.array(graph.key, dtype=I64)
        except (OverflowError, ValueError, TypeError, struct.error) as exc:
            raise FormatError(f"{where}: a value does not fit its field: {exc}") from exc
        n = len(graph.nodes)
        if len(edge_arr) and (edge_arr["src"].max() >= n or edge_arr["dst"].max() >= n):
            raise FormatError(f"{where}: an edge names a node outside 0..{n - 1}")
        eb = edge_arr.tobytes()
        eoff = self.edge_seen.get(eb)
        if eoff is None:
            eoff = self.edge_seen[eb] = len(self.edges) // EDGE_DT.itemsize
            self.edges += eb
        ntyp_off, _ = self.ntyp.add(bytes(types))
        self.rows[row].update(
            key_off=len(self.keys), key_len=len(graph.key), ntyp_off=ntyp_off, node_count=n,
            edge_off=eoff, edge_count=len(graph.edges),
        )
        self.keys.extend(key.tolist())
        self.chunks.append(chunk)  # rows are encoded in row order

    def _param_rows(self, graph: Graph, where: str) -> tuple[bytearray, np.ndarray, list[_Row], bytes,
                                                             list[_Row], list[_Row]]:
        """Per node its type and its row in the deduplicated param tables, and the tables (kernel
        rows, argument-byte pool, memset rows, memcpy rows): the hot loop of SAVE's encode."""
        nk = len(self.gs.kernels)
        types = bytearray(len(graph.nodes))
        refs = np.empty(len(graph.nodes), dtype=U32)
        kpar: list[tuple[int, ...]] = []
        kpar_seen: dict[tuple[int, ...], int] = {}
        bpol = _Interner()
        hashes: dict[int, int] = {}
        mset: dict[tuple[int, ...], int] = {}
        mcpy: dict[tuple[int, ...], int] = {}
        for i, node in enumerate(graph.nodes):
            t, p = node.type, node.params
            types[i] = int(t)
            if t not in SERIALIZABLE:
                raise UnsupportedNode(
                    f"{where} node {i}: {NodeType(t).name} cannot be archived: "
                    f"{_WHY_NOT.get(NodeType(t), 'unsupported node type')}"
                )
            rec: tuple[Any, ...]
            if t == NodeType.KERNEL:
                if not isinstance(p, KernelParams):
                    raise UnsupportedNode(f"{where} node {i}: KERNEL node without KernelParams")
                if not 0 <= p.kernel < nk:
                    raise UnsupportedNode(f"{where} node {i}: kernel index {p.kernel} not in 0..{nk - 1}")
                data = p.args if p.extra is None else p.extra
                off, n = bpol.add(bytes(data))
                h = hashes.get(off)
                if h is None:
                    h = hashes[off] = _args_hash(data)
                rec = (p.kernel, *p.grid, *p.block, p.shared_mem, off, n, self._layout(p),
                       self._attrs(p.attrs), KPAR_EXTRA if p.extra is not None else 0, 0, h)
                ref = kpar_seen.get(rec)
                if ref is None:
                    ref = kpar_seen[rec] = len(kpar)
                    kpar.append(rec)
            elif t == NodeType.MEMSET:
                if not isinstance(p, MemsetParams):
                    raise UnsupportedNode(f"{where} node {i}: MEMSET node without MemsetParams")
                rec = (p.dst, p.pitch, p.value, p.element_size, p.width, p.height)
                ref = mset.setdefault(rec, len(mset))
            elif t == NodeType.MEMCPY:
                if not isinstance(p, MemcpyParams):
                    raise UnsupportedNode(f"{where} node {i}: MEMCPY node without MemcpyParams")
                rec = (p.dst, p.src, p.size)
                ref = mcpy.setdefault(rec, len(mcpy))
            elif t in (NodeType.WAIT_EVENT, NodeType.EVENT_RECORD):
                if not isinstance(p, EventParams):
                    raise UnsupportedNode(f"{where} node {i}: {t.name} node without EventParams")
                ref = p.event
            elif t == NodeType.GRAPH:
                if not isinstance(p, Graph):
                    raise UnsupportedNode(f"{where} node {i}: GRAPH node without a child Graph")
                ref = self.add_graph(p, f"{where} node {i} (child graph)", child=True)
            else:  # EMPTY
                ref = NONE
            refs[i] = ref
        return types, refs, kpar, bytes(bpol.buf), list(mset), list(mcpy)


def unions_by_default() -> bool:
    """Whether SAVE writes union templates (default; EMBER_UNION_TEMPLATES=0 turns them off). SAVE
    proves them and drops them when a member differs; LOAD uses those an archive holds."""
    return settings.on("EMBER_UNION_TEMPLATES")


def encode(
    gs: GraphSet, groups: Sequence[TopologyGroup] | None = None, level: int = DEFAULT_LEVEL,
    unions: Sequence[UnionGroup] | bool | None = None,
) -> bytes:
    """Encode a GraphSet. `groups` defaults to `topology.group_graphs(gs.graphs, ...)`; `unions`
    (union templates, ember.archive.union) to `union_groups(...)` when `unions_by_default()`
    (True/False: computed or none).

    Raises UnsupportedNode (naming graph, node and reason) for nodes that cannot be restored.
    """
    if len(gs.function_attrs) not in (0, len(gs.kernels)):
        raise FormatError(
            f"GraphSet has {len(gs.kernels)} kernels but {len(gs.function_attrs)} function_attrs"
        )
    if groups is None:
        try:
            groups = group_graphs(gs.graphs, gs.function_attrs)
        except ValueError as exc:
            raise FormatError(str(exc)) from exc
    if unions is None:
        unions = unions_by_default()
    if isinstance(unions, bool):
        unions = union_groups(gs.graphs, gs.function_attrs) if unions else []
    enc = _Encoder(gs)
    for i, g in enumerate(gs.graphs):
        enc.add_graph(g, f"graph {i} (key {tuple(g.key)})", child=False)
    union_rows = [enc.add_graph(u.graph, f"union template {u.index}", child=False) for u in unions]
    for row in union_rows:
        enc.rows[row]["flags"] = GRAPH_IS_UNION
    done = 0
    while done < len(enc.pending):  # children are appended while encoding their parents
        row, graph, where = enc.pending[done]
        enc.encode_graph(row, graph, where)
        done += 1
    plain = zstd.ZstdCompressor(level=level, write_checksum=True)
    frames = _compress_chunks(enc, groups, level, plain)
    index = _pack_index(enc, groups, unions, union_rows)
    index_frame = plain.compress(index)
    chunks_off = OUTER.size + len(index_frame)
    header = OUTER.pack(MAGIC, MAJOR, MINOR, OUTER.size, 0, OUTER.size, len(index_frame), len(index),
                        chunks_off)
    return header + index_frame + b"".join(frames)


def _compress_chunks(enc: _Encoder, groups: Sequence[TopologyGroup], level: int,
                     plain: zstd.ZstdCompressor) -> list[bytes]:
    """One zstd frame per graph row: templates alone, group members against their template's raw
    chunk (a raw-content dictionary). Fills each row's group and chunk fields."""
    roots = len(enc.gs.graphs)
    gidx = group_index(groups, roots)
    template_row = {grp.index: grp.template for grp in groups}
    dicts: dict[int, zstd.ZstdCompressor] = {}
    frames: list[bytes] = []
    offset = 0
    for row, r in enumerate(enc.rows):
        raw = enc.chunks[row]
        is_root = row < roots
        group = gidx[row] if is_root else -1
        dict_row = template_row[group] if is_root and template_row[group] != row else -1
        if dict_row >= 0:
            comp = dicts.get(dict_row)
            if comp is None:
                d = zstd.ZstdCompressionDict(enc.chunks[dict_row], dict_type=zstd.DICT_TYPE_RAWCONTENT)
                comp = dicts[dict_row] = zstd.ZstdCompressor(level=level, dict_data=d, write_checksum=True)
            frame = comp.compress(raw)
        else:
            frame = plain.compress(raw)
        r.update(group=group, chunk_off=offset, chunk_len=len(frame), chunk_raw=len(raw), dict_row=dict_row,
                 reserved=0)
        frames.append(frame)
        offset += len(frame)
    return frames


def _union_sections(roots: int, unions: Sequence[UnionGroup], union_rows: list[int]
                    ) -> dict[bytes, np.ndarray]:
    """UNIO (each union's template row), UMEM (each root's union and slot run), USLT (slot runs,
    identical runs stored once)."""
    umem = np.zeros(roots, dtype=UMEM_DT)
    umem["union"] = -1
    pool: list[int] = []
    runs: dict[tuple[int, ...], int] = {}
    for u in unions:
        for m, slots in zip(u.members, u.slots, strict=True):
            off = runs.get(slots)
            if off is None:
                off = runs[slots] = len(pool)
                pool.extend(slots)
            umem[m] = (u.index, off)
    unio = np.array([(row, 0) for row in union_rows], dtype=UNIO_DT)
    return {b"UNIO": unio, b"UMEM": umem, b"USLT": np.array(pool, dtype=U32)}


def _pack_index(enc: _Encoder, groups: Sequence[TopologyGroup], unions: Sequence[UnionGroup] = (),
                union_rows: list[int] | None = None) -> bytes:
    """The index container (uncompressed): graph rows, keys, groups, pools, kernels, strings,
    union templates."""
    gs = enc.gs
    fattrs = list(gs.function_attrs) or [FunctionAttrs() for _ in gs.kernels]
    kern = []
    for k in gs.kernels:
        io, il = enc.strs.add(k.image.encode())
        no, nl = enc.strs.add(k.name.encode())
        kern.append((io, il, no, nl))
    grph = np.zeros(len(enc.rows), dtype=GRPH_DT)
    for name in GRPH_DT.names or ():
        grph[name] = [r[name] for r in enc.rows]
    return pack_container({
        b"GRPH": grph,
        b"ROOT": np.arange(len(gs.graphs), dtype=U32),
        b"KEYS": np.array(enc.keys, dtype=I64),
        b"TOPO": np.array([(bytes.fromhex(g.signature), g.template) for g in groups], dtype=TOPO_DT),
        b"NTYP": bytes(enc.ntyp.buf),
        b"EDGE": np.frombuffer(bytes(enc.edges), dtype=EDGE_DT),
        b"KERN": np.array(kern, dtype=KERN_DT),
        b"FATR": np.array([(f.max_dynamic_shared, *f.required_cluster, f.non_portable_cluster, f.carveout)
                           for f in fattrs], dtype=FATR_DT),
        b"STRS": bytes(enc.strs.buf),
        b"LAYO": np.array(enc.lpar_spans, dtype=SPAN_DT),
        b"LPAR": np.array(enc.lpar, dtype=LPAR_DT),
        b"ATTS": np.array(enc.atts, dtype=SPAN_DT),
        b"ATTR": np.array(enc.attr_rows, dtype=ATTR_DT),
        b"AVAL": bytes(enc.aval.buf),
        **_union_sections(len(gs.graphs), unions, union_rows or []),
    })
