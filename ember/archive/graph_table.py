"""The graph table: a versioned binary encoding of a `GraphSet`, decoded lazily per graph.

Written by SAVE (`encode`), read by LOAD, `ember inspect` and `ember verify` (`GraphTable`).
The byte-level spec is docs/archive-format.md; in short (all integers little-endian):

    outer header (48 B)   "EMGT", major, minor, header size, flags, index frame, chunk area
    index frame (zstd)    a section container: graph rows, keys, topology groups, node-type and
                          edge pools (deduplicated: graphs of one group share them), kernels,
                          function attributes, argument layouts, attribute sets, strings
    chunk frames (zstd)   one per graph: its per-node param references and its param rows
                          (kernel launches, argument bytes, memsets, memcpys). A graph's chunk is
                          compressed with its group template's raw chunk as a zstd raw-content
                          dictionary, so argument bytes repeated across the group cost ~nothing.

Decoding the table (`GraphTable(blob)`) reads the header and the index only: a few numpy views,
no per-node Python objects. A graph's chunk is decompressed on first use (`chunk(i)`, tens of
microseconds) and turned into `graphs.Graph` objects only when asked (`graph(i)`). Inside a
chunk, identical rows are stored once, and every kernel row carries a 64-bit hash of its argument
bytes, so `changed_nodes(i, j)` finds the nodes whose params differ between two graphs of one
group with a vectorised compare: what LOAD needs to switch a template by exec update.

API for LOAD (stable names): `decode(blob)` / `GraphTable(blob)`; `.count`, `.keys`,
`.key_index`, `.groups` (`GroupInfo`: index, signature, members, template — root indices),
`.group_of(i)`, `.kernels`, `.function_attrs`, `.node_types(i)`, `.edges(i)` (numpy, no chunk
decoded); `.chunk(i)` (numpy param tables), `.graph(i)` / `.graph_by_key(key)` (a
`graphs.Graph`), `.changed_nodes(i, j)` and `.nodes(i, indices)` (a template switch decodes
only what differs), `.to_graphset()`, `.validate(threads)`, `.node_type_counts()`.

Versioning: a reader refuses another MAJOR (`FormatVersionError`); for a newer MINOR it reads
the sections and row fields it knows: unknown sections are skipped and rows may grow at the end
(each section records its row size).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import zstandard as zstd

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
from ember.archive.topology import TopologyGroup, group_graphs, group_index

MAGIC = b"EMGT"
MAJOR = 1
MINOR = 0
VERSION = f"{MAJOR}.{MINOR}"
NONE = 0xFFFFFFFF
DEFAULT_LEVEL = 3

OUTER = struct.Struct("<4sHHIIQQQQ")  # magic, major, minor, header_size, flags, index off/len/raw, chunks
CONTAINER = struct.Struct("<II")  # section count, reserved
SECTION = struct.Struct("<4sIQQQ")  # id, row size, row count, offset, length
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

SERIALIZABLE = frozenset(
    {NodeType.KERNEL, NodeType.MEMCPY, NodeType.MEMSET, NodeType.GRAPH, NodeType.EMPTY,
     NodeType.WAIT_EVENT, NodeType.EVENT_RECORD}
)
_WHY_NOT = {
    NodeType.HOST: "host nodes call a CPU function pointer with user data that cannot be saved",
    NodeType.MEM_ALLOC: "mem-alloc nodes get their address chosen by CUDA at instantiate",
    NodeType.MEM_FREE: "mem-free nodes pair with mem-alloc nodes, which cannot be restored",
    NodeType.EXT_SEMAS_SIGNAL: "external semaphores are process-local handles",
    NodeType.EXT_SEMAS_WAIT: "external semaphores are process-local handles",
    NodeType.BATCH_MEM_OP: "batch memory operations are not supported yet",
    NodeType.CONDITIONAL: "conditional nodes (handles, bodies) are not supported yet",
}

_SERIALIZABLE_INTS = frozenset(int(t) for t in SERIALIZABLE)
_KERNEL, _MEMSET, _MEMCPY, _GRAPH = (int(NodeType.KERNEL), int(NodeType.MEMSET), int(NodeType.MEMCPY),
                                     int(NodeType.GRAPH))

# Row layouts (packed, little-endian). Field order is part of the format: append only.
GRPH_DT = np.dtype([
    ("key_off", "<u4"), ("key_len", "<u4"), ("ntyp_off", "<u4"), ("node_count", "<u4"),
    ("edge_off", "<u4"), ("edge_count", "<u4"), ("group", "<i4"), ("flags", "<u4"),
    ("chunk_off", "<u8"), ("chunk_len", "<u4"), ("chunk_raw", "<u4"), ("dict_row", "<i4"),
    ("reserved", "<u4"),
])
GRAPH_IS_CHILD = 1
TOPO_DT = np.dtype([("signature", "V32"), ("template", "<u4")])
EDGE_DT = np.dtype([("src", "<u4"), ("dst", "<u4"), ("from_port", "u1"), ("to_port", "u1"),
                    ("type", "u1"), ("pad", "u1")])
KERN_DT = np.dtype([("image_off", "<u4"), ("image_len", "<u4"), ("name_off", "<u4"), ("name_len", "<u4")])
FATR_DT = np.dtype([("max_dynamic_shared", "<i4"), ("cluster_x", "<u4"), ("cluster_y", "<u4"),
                    ("cluster_z", "<u4"), ("non_portable_cluster", "<i4"), ("carveout", "<i4")])
SPAN_DT = np.dtype([("off", "<u4"), ("count", "<u4")])
LPAR_DT = np.dtype([("offset", "<u4"), ("size", "<u4")])
ATTR_DT = np.dtype([("id", "<u4"), ("value_off", "<u4"), ("value_len", "<u4")])
KPAR_DT = np.dtype([
    ("kernel", "<u4"), ("gx", "<u4"), ("gy", "<u4"), ("gz", "<u4"), ("bx", "<u4"), ("by", "<u4"),
    ("bz", "<u4"), ("smem", "<u4"), ("args_off", "<u4"), ("args_len", "<u4"), ("layout", "<u4"),
    ("attrs", "<u4"), ("flags", "<u4"), ("reserved", "<u4"), ("args_hash", "<u8"),
])
KPAR_EXTRA = 1  # argument bytes are the opaque `extra` buffer, not a packed argument list
MSET_DT = np.dtype([("dst", "<u8"), ("pitch", "<u8"), ("value", "<u4"), ("element_size", "<u4"),
                    ("width", "<u8"), ("height", "<u8")])
MCPY_DT = np.dtype([("dst", "<u8"), ("src", "<u8"), ("size", "<u8")])
U8, U32, I64 = np.dtype("u1"), np.dtype("<u4"), np.dtype("<i8")

# Section ids and their row types. Index container:
INDEX_SECTIONS: dict[bytes, np.dtype] = {
    b"GRPH": GRPH_DT, b"ROOT": U32, b"KEYS": I64, b"TOPO": TOPO_DT, b"NTYP": U8, b"EDGE": EDGE_DT,
    b"KERN": KERN_DT, b"FATR": FATR_DT, b"STRS": U8, b"LAYO": SPAN_DT, b"LPAR": LPAR_DT,
    b"ATTS": SPAN_DT, b"ATTR": ATTR_DT, b"AVAL": U8,
}
# Chunk container (one per graph):
CHUNK_SECTIONS: dict[bytes, np.dtype] = {
    b"REFS": U32, b"KPAR": KPAR_DT, b"BPOL": U8, b"MSET": MSET_DT, b"MCPY": MCPY_DT,
}


class FormatError(ValueError):
    """The graph table is damaged or not a graph table; the message says where."""


class FormatVersionError(FormatError):
    """The graph table was written by a format MAJOR version this reader does not know."""


class UnsupportedNode(FormatError):
    """SAVE met a node that cannot be restored exactly; names the graph, node and reason."""


def _args_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# ----------------------------------------------------------------------------------------------
# Section containers


def _pack_container(sections: dict[bytes, np.ndarray | bytes]) -> bytes:
    head = CONTAINER.size + SECTION.size * len(sections)
    out = bytearray()
    directory = []
    offset = (head + 7) & ~7
    for sid, data in sections.items():
        if isinstance(data, np.ndarray):
            row, count, payload = data.dtype.itemsize, len(data), data.tobytes()
        else:
            row, count, payload = 1, len(data), bytes(data)
        directory.append(SECTION.pack(sid, row, count, offset, len(payload)))
        out += payload
        pad = (-len(payload)) & 7
        out += b"\0" * pad
        offset += len(payload) + pad
    header = CONTAINER.pack(len(sections), 0) + b"".join(directory)
    return header + b"\0" * (((head + 7) & ~7) - head) + bytes(out)


def _with_itemsize(dt: np.dtype, row: int) -> np.dtype:
    """The known fields of `dt` over rows of `row` bytes (newer minors may append fields)."""
    if row == dt.itemsize:
        return dt
    if dt.names is None:
        raise FormatError(f"row size {row} for a scalar section of {dt.itemsize}-byte items")
    return np.dtype({"names": list(dt.names), "formats": [dt.fields[n][0] for n in dt.names],
                     "offsets": [dt.fields[n][1] for n in dt.names], "itemsize": row})


def _unpack_container(buf: bytes | memoryview, known: dict[bytes, np.dtype], what: str) -> dict[bytes, Any]:
    mv = memoryview(buf)
    if len(mv) < CONTAINER.size:
        raise FormatError(f"{what}: truncated ({len(mv)} bytes)")
    (count, _) = CONTAINER.unpack_from(mv, 0)
    if CONTAINER.size + count * SECTION.size > len(mv):
        raise FormatError(f"{what}: directory of {count} sections overruns {len(mv)} bytes")
    out: dict[bytes, Any] = {}
    for i in range(count):
        sid, row, n, off, length = SECTION.unpack_from(mv, CONTAINER.size + i * SECTION.size)
        if sid not in known:
            continue  # a newer minor's section
        dt = known[sid]
        if row < dt.itemsize or row * n != length or off + length > len(mv):
            raise FormatError(
                f"{what}: section {sid.decode(errors='replace')} is malformed "
                f"(row {row} B x {n} at {off}+{length}, container {len(mv)} B)"
            )
        out[sid] = np.frombuffer(mv, dtype=_with_itemsize(dt, row), count=n, offset=off)
    missing = [s.decode() for s in known if s not in out]
    if missing:
        raise FormatError(f"{what}: sections missing: {', '.join(missing)}")
    return out


# ----------------------------------------------------------------------------------------------
# Encoding


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
        try:
            chunk = _pack_container({
                b"REFS": refs,
                b"KPAR": np.array(kpar, dtype=KPAR_DT),
                b"BPOL": bytes(bpol.buf),
                b"MSET": np.array(list(mset), dtype=MSET_DT),
                b"MCPY": np.array(list(mcpy), dtype=MCPY_DT),
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


def encode(
    gs: GraphSet, groups: Sequence[TopologyGroup] | None = None, level: int = DEFAULT_LEVEL
) -> bytes:
    """Encode a GraphSet. `groups` defaults to `topology.group_graphs(gs.graphs, ...)`.

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
    gidx = group_index(groups, len(gs.graphs))
    enc = _Encoder(gs)
    for i, g in enumerate(gs.graphs):
        enc.add_graph(g, f"graph {i} (key {tuple(g.key)})", child=False)
    done = 0
    while done < len(enc.pending):  # children are appended while encoding their parents
        row, graph, where = enc.pending[done]
        enc.encode_graph(row, graph, where)
        done += 1

    # Compress chunks: templates alone, group members against their template's raw chunk.
    template_row = {grp.index: grp.template for grp in groups}
    plain = zstd.ZstdCompressor(level=level, write_checksum=True)
    dicts: dict[int, zstd.ZstdCompressor] = {}
    frames: list[bytes] = []
    offset = 0
    for row, r in enumerate(enc.rows):
        raw = enc.chunks[row]
        is_root = row < len(gs.graphs)
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

    fattrs = list(gs.function_attrs) or [FunctionAttrs() for _ in gs.kernels]
    kern = []
    for k in gs.kernels:
        io, il = enc.strs.add(k.image.encode())
        no, nl = enc.strs.add(k.name.encode())
        kern.append((io, il, no, nl))
    grph = np.zeros(len(enc.rows), dtype=GRPH_DT)
    for name in GRPH_DT.names:
        grph[name] = [r[name] for r in enc.rows]
    index = _pack_container({
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
    })
    index_frame = plain.compress(index)
    chunks_off = OUTER.size + len(index_frame)
    header = OUTER.pack(MAGIC, MAJOR, MINOR, OUTER.size, 0, OUTER.size, len(index_frame), len(index),
                        chunks_off)
    return header + index_frame + b"".join(frames)


# ----------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True)
class GraphChunk:
    """One graph's decoded param tables (numpy views over the decompressed chunk).

    refs[i] is node i's row: in `kpar` (KERNEL), `mset` (MEMSET), `mcpy` (MEMCPY), the event
    index (WAIT_EVENT/EVENT_RECORD), the GRPH row of the child (GRAPH) or NONE (EMPTY).
    """

    raw: bytes
    refs: np.ndarray
    kpar: np.ndarray
    bpol: np.ndarray
    mset: np.ndarray
    mcpy: np.ndarray

    def args(self, kpar_row: int) -> bytes:
        r = self.kpar[kpar_row]
        return self.raw_bytes(int(r["args_off"]), int(r["args_len"]))

    def raw_bytes(self, off: int, n: int) -> bytes:
        return self.bpol[off:off + n].tobytes()


@dataclass(frozen=True)
class GroupInfo:
    index: int
    signature: str
    members: tuple[int, ...]  # root graph indices
    template: int  # root graph index


def _open_outer(blob: bytes | memoryview) -> tuple[int, int, int, int, int, int]:
    mv = memoryview(blob)
    if len(mv) >= 4 and bytes(mv[:4]) == _ZSTD_MAGIC:
        raise FormatError("this is a zstd frame, not a graph table (decompress the blob first?)")
    if len(mv) < OUTER.size:
        raise FormatError(f"graph table truncated: {len(mv)} bytes, header needs {OUTER.size}")
    magic, major, minor, hsize, flags, ioff, ilen, iraw, coff = OUTER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FormatError(f"not an ember graph table (magic {magic!r}, expected {MAGIC!r})")
    if major != MAJOR:
        raise FormatVersionError(
            f"graph table format {major}.{minor} is not readable by this ember (reads {MAJOR}.x): "
            + ("upgrade ember" if major > MAJOR else "SAVE the archive again")
        )
    if ioff + ilen > len(mv) or coff > len(mv) or hsize < OUTER.size:
        raise FormatError(f"graph table truncated: index at {ioff}+{ilen}, blob is {len(mv)} bytes")
    return minor, flags, ioff, ilen, iraw, coff


class GraphTable:
    """A decoded graph table. Cheap to open; graphs are decoded on demand.

    Root graphs (the GraphSet's graphs) are indexed 0..count-1 in archive order. Rows beyond
    that in `rows` are child graphs.
    """

    def __init__(self, blob: bytes | memoryview) -> None:
        self.blob = memoryview(blob)
        self.minor, self.flags, ioff, ilen, iraw, coff = _open_outer(self.blob)
        try:
            frame = bytes(self.blob[ioff:ioff + ilen])
            index = zstd.ZstdDecompressor().decompress(frame, max_output_size=iraw)
        except zstd.ZstdError as exc:
            raise FormatError(f"graph table index does not decompress ({exc}): damaged archive") from exc
        if len(index) != iraw:
            raise FormatError(f"graph table index is {len(index)} bytes, header says {iraw}")
        s = _unpack_container(index, INDEX_SECTIONS, "graph table index")
        self._chunks_off = coff
        self.rows: np.ndarray = s[b"GRPH"]
        self.roots: np.ndarray = s[b"ROOT"]
        self._keys, self._ntyp, self._edges = s[b"KEYS"], s[b"NTYP"], s[b"EDGE"]
        self._topo, self._kern, self._fatr, self._strs = s[b"TOPO"], s[b"KERN"], s[b"FATR"], s[b"STRS"]
        self._layo, self._lpar = s[b"LAYO"], s[b"LPAR"]
        self._atts, self._attr, self._aval = s[b"ATTS"], s[b"ATTR"], s[b"AVAL"]
        self._tls = threading.local()  # zstd decompressors are not thread-safe: one set per thread
        self._cache: dict[int, GraphChunk] = {}
        self._pos_cache: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        self._check_index()

    # ---- index-level facts (no chunk decoded) ----
    def _check_index(self) -> None:
        r, nrows = self.rows, len(self.rows)
        if len(self.roots) and int(self.roots.max()) >= nrows:
            raise FormatError("graph table index: a root names a graph row that does not exist")
        if nrows == 0:
            return

        def over(end: np.ndarray, limit: int) -> bool:
            return bool((end.astype(np.int64) > limit).any())

        if over(r["key_off"].astype(np.int64) + r["key_len"], len(self._keys)) \
                or over(r["ntyp_off"].astype(np.int64) + r["node_count"], len(self._ntyp)) \
                or over(r["edge_off"].astype(np.int64) + r["edge_count"], len(self._edges)):
            raise FormatError("graph table index: a graph row points outside the key/node/edge pools")
        chunk_area = len(self.blob) - self._chunks_off
        if over(r["chunk_off"].astype(np.int64) + r["chunk_len"], chunk_area):
            raise FormatError(
                f"graph table truncated: graph chunks need {int((r['chunk_off'] + r['chunk_len']).max())} "
                f"bytes after the index, {chunk_area} present"
            )
        if (r["dict_row"] >= nrows).any() or ((r["group"] >= len(self._topo)) & (r["group"] >= 0)).any():
            raise FormatError("graph table index: a graph row names a missing template or group")
        if len(self._topo) and int(self._topo["template"].max()) >= nrows:
            raise FormatError("graph table index: a topology group names a missing template")

    @property
    def version(self) -> str:
        return f"{MAJOR}.{self.minor}"

    @property
    def count(self) -> int:
        return len(self.roots)

    def __len__(self) -> int:
        return self.count

    def _row(self, i: int) -> int:
        if not 0 <= i < len(self.roots):
            raise IndexError(f"graph {i} not in 0..{len(self.roots) - 1}")
        return int(self.roots[i])

    def key_of_row(self, row: int) -> tuple[int, ...]:
        r = self.rows[row]
        o = int(r["key_off"])
        return tuple(self._keys[o:o + int(r["key_len"])].tolist())

    @cached_property
    def keys(self) -> list[tuple[int, ...]]:
        return [self.key_of_row(int(r)) for r in self.roots]

    @cached_property
    def key_index(self) -> dict[tuple[int, ...], int]:
        return {k: i for i, k in enumerate(self.keys)}

    @cached_property
    def groups(self) -> list[GroupInfo]:
        root_of_row = {int(r): i for i, r in enumerate(self.roots)}
        members: list[list[int]] = [[] for _ in range(len(self._topo))]
        for i, row in enumerate(self.roots):
            g = int(self.rows[int(row)]["group"])
            if g >= 0:
                members[g].append(i)
        return [
            GroupInfo(n, bytes(t["signature"]).hex(), tuple(members[n]),
                      root_of_row.get(int(t["template"]), -1))
            for n, t in enumerate(self._topo)
        ]

    def group_of(self, i: int) -> int:
        return int(self.rows[self._row(i)]["group"])

    def node_types(self, i: int, *, row: bool = False) -> np.ndarray:
        r = self.rows[i if row else self._row(i)]
        o = int(r["ntyp_off"])
        return self._ntyp[o:o + int(r["node_count"])]

    def edges(self, i: int, *, row: bool = False) -> np.ndarray:
        r = self.rows[i if row else self._row(i)]
        o = int(r["edge_off"])
        return self._edges[o:o + int(r["edge_count"])]

    def _str(self, off: int, n: int) -> str:
        return self._strs[off:off + n].tobytes().decode()

    @cached_property
    def kernels(self) -> list[KernelRef]:
        return [KernelRef(self._str(int(k["image_off"]), int(k["image_len"])),
                          self._str(int(k["name_off"]), int(k["name_len"]))) for k in self._kern]

    @cached_property
    def function_attrs(self) -> list[FunctionAttrs]:
        return [FunctionAttrs(int(f["max_dynamic_shared"]),
                              (int(f["cluster_x"]), int(f["cluster_y"]), int(f["cluster_z"])),
                              int(f["non_portable_cluster"]), int(f["carveout"])) for f in self._fatr]

    def node_type_counts(self) -> dict[str, int]:
        """Node-type name → count over every graph row (children included)."""
        total = np.zeros(256, dtype=np.int64)
        per_seg: dict[tuple[int, int], np.ndarray] = {}
        for r in self.rows:
            seg = (int(r["ntyp_off"]), int(r["node_count"]))
            counts = per_seg.get(seg)
            if counts is None:
                counts = per_seg[seg] = np.bincount(self._ntyp[seg[0]:seg[0] + seg[1]], minlength=256)
            total += counts
        return {_type_name(t): int(total[t]) for t in np.nonzero(total)[0]}

    @property
    def node_total(self) -> int:
        return int(self.rows["node_count"].sum()) if len(self.rows) else 0

    # ---- chunks ----
    def _decompressor(self, dict_row: int) -> zstd.ZstdDecompressor:
        mine: dict[int, zstd.ZstdDecompressor] | None = getattr(self._tls, "d", None)
        if mine is None:
            mine = self._tls.d = {}
        d = mine.get(dict_row)
        if d is None:
            if dict_row < 0:
                d = zstd.ZstdDecompressor()
            else:
                raw = self.chunk_of_row(dict_row).raw
                d = zstd.ZstdDecompressor(dict_data=zstd.ZstdCompressionDict(
                    raw, dict_type=zstd.DICT_TYPE_RAWCONTENT))
            mine[dict_row] = d
        return d

    def _what(self, row: int) -> str:
        return f"graph {self.key_of_row(row)} (row {row})"

    def chunk_of_row(self, row: int, *, keep: bool = True) -> GraphChunk:
        """Row's param tables; cached unless keep=False (validation of a whole table: keeping
        every chunk costs more in fresh memory than decoding them)."""
        c = self._cache.get(row)
        if c is not None:
            return c
        _, _, _, _, _, _, _, _, chunk_off, chunk_len, chunk_raw, dict_row, _ = self._row_info[row][:13]
        if dict_row == row:
            raise FormatError(f"graph row {row}: chunk compressed against itself")
        off = self._chunks_off + chunk_off
        try:
            raw = self._decompressor(dict_row).decompress(self.blob[off:off + chunk_len],
                                                           max_output_size=chunk_raw)
        except zstd.ZstdError as exc:
            msg = f"{self._what(row)}: params do not decompress ({exc}): damaged archive"
            raise FormatError(msg) from exc
        if len(raw) != chunk_raw:
            raise FormatError(f"{self._what(row)}: params are {len(raw)} bytes, index says {chunk_raw}")
        try:
            s = _unpack_container(raw, CHUNK_SECTIONS, "params")
            c = GraphChunk(raw, s[b"REFS"], s[b"KPAR"], s[b"BPOL"], s[b"MSET"], s[b"MCPY"])
            self._check_chunk(row, c)
        except FormatError as exc:
            raise FormatError(f"{self._what(row)}: {exc}") from None
        if keep:
            self._cache[row] = c
        return c

    def chunk(self, i: int) -> GraphChunk:
        """Graph i's param tables (decompressed once, then cached)."""
        return self.chunk_of_row(self._row(i))

    @cached_property
    def _row_info(self) -> list[tuple[int, ...]]:
        """GRPH rows as Python tuples: per-chunk paths avoid numpy scalar access."""
        return self.rows.tolist()

    def _positions(self, row: int) -> dict[int, np.ndarray]:
        """Node positions per node type for a row's node-type segment (cached: groups share it)."""
        info = self._row_info[row]
        seg = (info[2], info[3])  # ntyp_off, node_count
        pos = self._pos_cache.get(seg)
        if pos is None:
            types = self._ntyp[seg[0]:seg[0] + seg[1]]
            present = np.unique(types)
            bad = [int(t) for t in present if int(t) not in _SERIALIZABLE_INTS]
            if bad:
                raise FormatError(f"graph row {row}: node types {bad} cannot appear in an archive")
            pos = {int(t): np.nonzero(types == t)[0] for t in present}
            self._pos_cache[seg] = pos
        return pos

    def _check_chunk(self, row: int, c: GraphChunk) -> None:
        count = self._row_info[row][3]
        if len(c.refs) != count:
            raise FormatError(f"{len(c.refs)} param refs for {count} nodes")
        pos = self._positions(row)
        for t, n in ((_KERNEL, len(c.kpar)), (_MEMSET, len(c.mset)), (_MEMCPY, len(c.mcpy)),
                     (_GRAPH, len(self.rows))):
            p = pos.get(t)
            if p is not None and len(p) and int(c.refs[p].max()) >= n:
                raise FormatError(f"a {NodeType(t).name} node refers to a missing row")
        k = c.kpar
        if not len(k):
            return
        kern_max, attrs_max = int(k["kernel"].max()), int(k["attrs"].max())
        args_end = int((k["args_off"].astype(np.int64) + k["args_len"]).max())
        layout_top = int((k["layout"] + np.uint32(1)).max())  # NONE + 1 wraps to 0
        if kern_max >= len(self._kern):
            raise FormatError("a kernel node names a missing kernel")
        if args_end > len(c.bpol):
            raise FormatError("kernel arguments point outside the argument pool")
        if layout_top > len(self._layo) or attrs_max >= len(self._atts):
            raise FormatError("a kernel node names a missing layout or attribute set")

    def changed_nodes(self, i: int, j: int) -> np.ndarray:
        """Node indices of graph i whose params differ from graph j's (same topology group).

        Kernel rows are compared field by field plus the argument-bytes hash; memset/memcpy rows
        by value; event nodes by event index; a child-graph node counts as changed when any node
        of its child differs. What LOAD must set after a template switch by exec update.
        """
        if self.group_of(i) != self.group_of(j) or self.group_of(i) < 0:
            raise ValueError(f"graphs {i} and {j} are not in one topology group")
        return self._changed_rows(self._row(i), self._row(j), 0)

    def _changed_rows(self, ra: int, rb: int, depth: int) -> np.ndarray:
        if depth > 16:
            raise FormatError("child graphs nested deeper than 16 levels (a cycle?)")
        a, b = self.chunk_of_row(ra), self.chunk_of_row(rb)
        pos = self._positions(ra)
        if len(a.refs) != len(b.refs) or self.rows[ra]["ntyp_off"] != self.rows[rb]["ntyp_off"]:
            raise ValueError(f"graph rows {ra} and {rb} do not share a topology")
        diff = np.zeros(len(a.refs), dtype=bool)
        for t, ta, tb in ((_KERNEL, a.kpar, b.kpar), (_MEMSET, a.mset, b.mset), (_MEMCPY, a.mcpy, b.mcpy)):
            p = pos.get(t)
            if p is None or not len(p):
                continue
            xa, xb = ta[a.refs[p]], tb[b.refs[p]]
            d = np.zeros(len(p), dtype=bool)
            for n in ta.dtype.names:
                if n not in ("args_off", "reserved"):
                    d |= xa[n] != xb[n]
            diff[p] = d
        for t in (int(NodeType.WAIT_EVENT), int(NodeType.EVENT_RECORD)):
            p = pos.get(t)
            if p is not None:
                diff[p] = a.refs[p] != b.refs[p]
        for n in pos.get(_GRAPH, ()):
            diff[n] = len(self._changed_rows(int(a.refs[n]), int(b.refs[n]), depth + 1)) > 0
        return np.nonzero(diff)[0]

    # ---- materialisation into graphs.Graph ----
    def _layout(self, idx: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        span = self._layo[idx]
        rows = self._lpar[int(span["off"]):int(span["off"]) + int(span["count"])]
        return tuple(rows["offset"].tolist()), tuple(rows["size"].tolist())

    def _attrs(self, idx: int) -> dict[int, bytes]:
        if idx == 0:
            return {}
        span = self._atts[idx]
        out = {}
        for a in self._attr[int(span["off"]):int(span["off"]) + int(span["count"])]:
            o = int(a["value_off"])
            out[int(a["id"])] = self._aval[o:o + int(a["value_len"])].tobytes()
        return out

    def _nodes_of_row(self, row: int, indices: Sequence[int] | None, depth: int) -> list[Node]:
        if depth > 16:
            raise FormatError("child graphs nested deeper than 16 levels (a cycle?)")
        c = self.chunk_of_row(row)
        all_types = self.node_types(row, row=True)
        if indices is None:
            types, refs = all_types.tolist(), c.refs.tolist()
        else:
            idx = np.asarray(indices, dtype=np.int64)
            if len(idx) and (idx.min() < 0 or idx.max() >= len(all_types)):
                raise IndexError(f"node index out of range 0..{len(all_types) - 1}")
            types, refs = all_types[idx].tolist(), c.refs[idx].tolist()
        kpar, mset, mcpy, bpol = c.kpar.tolist(), c.mset.tolist(), c.mcpy.tolist(), c.bpol
        layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        attrs: dict[int, dict[int, bytes]] = {}
        nodes: list[Node] = []
        for t, ref in zip(types, refs, strict=True):
            nt = NodeType(t)
            if nt == NodeType.KERNEL:
                (kern, gx, gy, gz, bx, by, bz, smem, aoff, alen, lay, att, flags, _r, _h) = kpar[ref]
                data = bpol[aoff:aoff + alen].tobytes()
                if att not in attrs:
                    attrs[att] = self._attrs(att)
                if flags & KPAR_EXTRA:
                    kp = KernelParams(kern, (gx, gy, gz), (bx, by, bz), smem, extra=data,
                                      attrs=dict(attrs[att]))
                else:
                    if lay not in layouts:
                        layouts[lay] = self._layout(lay) if lay != NONE else ((), ())
                    offs, sizes = layouts[lay]
                    kp = KernelParams(kern, (gx, gy, gz), (bx, by, bz), smem, args=data, arg_offsets=offs,
                                      arg_sizes=sizes, attrs=dict(attrs[att]))
                nodes.append(Node(nt, kp))
            elif nt == NodeType.MEMSET:
                dst, pitch, value, es, w, h = mset[ref]
                nodes.append(Node(nt, MemsetParams(dst, pitch, value, es, w, h)))
            elif nt == NodeType.MEMCPY:
                dst, src, size = mcpy[ref]
                nodes.append(Node(nt, MemcpyParams(dst, src, size)))
            elif nt in (NodeType.WAIT_EVENT, NodeType.EVENT_RECORD):
                nodes.append(Node(nt, EventParams(ref)))
            elif nt == NodeType.GRAPH:
                nodes.append(Node(nt, self.graph_of_row(ref, depth + 1)))
            else:
                nodes.append(Node(nt, None))
        return nodes

    def graph_of_row(self, row: int, _depth: int = 0) -> Graph:
        nodes = self._nodes_of_row(row, None, _depth)
        edges = [Edge(s, d, fp, tp, ty) for s, d, fp, tp, ty, _ in self.edges(row, row=True).tolist()]
        return Graph(self.key_of_row(row), nodes, edges)

    def nodes(self, i: int, indices: Sequence[int]) -> list[Node]:
        """Only the given nodes of root graph i, decoded (e.g. `changed_nodes(i, template)`):
        what a template switch needs, without materialising the whole graph."""
        return self._nodes_of_row(self._row(i), indices, 0)

    def graph(self, i: int) -> Graph:
        """Root graph i as a `graphs.Graph` (decoded now; not cached)."""
        return self.graph_of_row(self._row(i))

    def graph_by_key(self, key: Sequence[int]) -> Graph:
        try:
            return self.graph(self.key_index[tuple(key)])
        except KeyError:
            raise KeyError(f"no graph with key {tuple(key)} in this archive") from None

    def to_graphset(self) -> GraphSet:
        return GraphSet([self.graph(i) for i in range(self.count)], self.kernels, self.function_attrs)

    def validate(self, threads: int = 0, keep: bool = False) -> None:
        """Decode every chunk and check every reference (raises FormatError).

        Template chunks stay cached; the others too with `keep=True` (LOAD warming everything).
        `threads` > 1 decompresses on a thread pool (zstd releases the GIL); 0 = automatic
        (a pool only with 4 or more CPUs: on fewer, threads cost more than they save).
        """
        import os
        from concurrent.futures import ThreadPoolExecutor

        for row in sorted({int(r) for r in self.rows["dict_row"] if r >= 0}):
            self.chunk_of_row(row)  # templates first: workers read them from the cache
        if threads <= 0:
            cpus = os.cpu_count() or 1
            threads = min(8, cpus) if cpus >= 4 else 1
        rest = [r for r in range(len(self.rows)) if r not in self._cache]

        def one(row: int) -> None:
            self.chunk_of_row(row, keep=keep)

        if threads <= 1 or len(rest) < 16:
            for row in rest:
                one(row)
            return
        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(one, rest, chunksize=8):
                pass

    def drop_cache(self) -> None:
        self._cache.clear()
        self._tls = threading.local()


def _type_name(t: int) -> str:
    try:
        return NodeType(t).name
    except ValueError:
        return f"TYPE_{t}"


def decode(blob: bytes | memoryview) -> GraphTable:
    """Open a graph table (header + index; graphs decode lazily)."""
    return GraphTable(blob)


# ----------------------------------------------------------------------------------------------
# Measurement


def parse_ms_512(graphs: int = 512, nodes: int = 1800, groups: int = 7, repeat: int = 5,
                 seed: int = 0) -> dict[str, Any]:
    """Decode timings on a synthetic archive shaped like an 8B decode set (for `ember bench`):
    kernel nodes (packed and `extra` arguments, cluster attributes), memsets, memcpys, events,
    programmatic edges, batch-dependent grids and arguments; no child graphs.

    Returns milliseconds (best of `repeat`) for: `open_ms` (header + index + every group's
    template chunk: what LOAD needs before building templates; this is `parse_ms_512`),
    `all_chunks_ms` (every graph's params decompressed and checked, one thread), `materialize_graph_ms`
    (one graph turned into Python `Graph` objects), and sizes.
    """
    from ember_bench.synthetic import synthetic_graphset

    gs = synthetic_graphset(graphs=graphs, nodes=nodes, groups=groups, seed=seed, child_graphs=False)
    t0 = time.perf_counter()
    blob = encode(gs)
    encode_s = time.perf_counter() - t0

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    def open_templates() -> GraphTable:
        table = GraphTable(blob)
        for g in table.groups:
            table.chunk(g.template)
        _ = table.keys
        return table

    def all_chunks() -> None:
        GraphTable(blob).validate(threads=1)

    table = open_templates()
    return {
        "graphs": graphs,
        "nodes_per_graph": nodes,
        "groups": len(table.groups),
        "parse_ms_512": round(best(open_templates), 3),
        "all_chunks_ms": round(best(all_chunks), 3),
        "materialize_graph_ms": round(best(lambda: table.graph(graphs // 2)), 3),
        "table_bytes": len(blob),
        "encode_s": round(encode_s, 2),
    }
