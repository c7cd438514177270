"""Decoding a graph table: `GraphTable(blob)` (what LOAD, `ember inspect` and `ember verify` read).

Opening reads the header and the index only (numpy views, no per-node Python objects); a graph's
chunk is decompressed on first use and turned into `graphs.Graph` objects only when asked. The
layout is ember/archive/table_layout.py; the API is listed in ember/archive/graph_table.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.ma  # np.unique imports it on first use: ~10 ms on LOAD's first key, not there
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
from ember.archive.table_layout import (
    CHUNK_SECTIONS,
    GRAPH_IS_UNION,
    INDEX_SECTIONS,
    KPAR_EXTRA,
    MAGIC,
    MAJOR,
    NONE,
    OPTIONAL_INDEX_SECTIONS,
    OUTER,
    SERIALIZABLE,
    FormatError,
    FormatVersionError,
    unpack_container,
)
from ember.archive.table_unions import UnionInfo, check_member, read_unions

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SERIALIZABLE_INTS = frozenset(int(t) for t in SERIALIZABLE)
_KERNEL, _MEMSET, _MEMCPY, _GRAPH = (int(NodeType.KERNEL), int(NodeType.MEMSET), int(NodeType.MEMCPY),
                                     int(NodeType.GRAPH))


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


# No index or chunk comes near this (an 8B decode set's index is a few MB): a larger size is a
# damaged or hostile header, refused before anything that size is allocated.
MAX_RAW = 1 << 30


def inflate(d: zstd.ZstdDecompressor, frame: bytes | memoryview, raw_size: int, what: str,
            said_by: str) -> bytes:
    """One zstd frame of the table → exactly `raw_size` bytes, else FormatError.

    The frame's own content size (SAVE writes it) must equal `raw_size` and stay under MAX_RAW:
    zstandard raises OverflowError for a size past ssize_t and would allocate whatever is named.
    """
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise FormatError(f"{what}: not a zstd frame ({exc}): damaged archive") from exc
    if declared != raw_size or not 0 <= raw_size <= MAX_RAW:
        raise FormatError(f"{what}: the frame holds {declared} bytes, the {said_by} says {raw_size}: "
                          "damaged archive")
    try:
        raw = d.decompress(frame, max_output_size=raw_size)
    except zstd.ZstdError as exc:
        raise FormatError(f"{what}: zstd refuses the frame ({exc}): damaged archive") from exc
    if len(raw) != raw_size:
        raise FormatError(f"{what}: {len(raw)} bytes, the {said_by} says {raw_size}")
    return raw


def read_header(blob: bytes | memoryview) -> tuple[int, int, int, int, int, int]:
    """The outer header, checked: (minor, flags, index offset, index length, index raw size, chunk area)."""
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
        self.minor, self.flags, ioff, ilen, iraw, coff = read_header(self.blob)
        frame = bytes(self.blob[ioff:ioff + ilen])
        index = inflate(zstd.ZstdDecompressor(), frame, iraw, "graph table index", "header")
        s = unpack_container(index, INDEX_SECTIONS, "graph table index", OPTIONAL_INDEX_SECTIONS)
        self._chunks_off = coff
        self.rows: np.ndarray = s[b"GRPH"]
        self.roots: np.ndarray = s[b"ROOT"]
        self._keys, self._ntyp, self._edges = s[b"KEYS"], s[b"NTYP"], s[b"EDGE"]
        self._topo, self._kern, self._fatr, self._strs = s[b"TOPO"], s[b"KERN"], s[b"FATR"], s[b"STRS"]
        self._layo, self._lpar = s[b"LAYO"], s[b"LPAR"]
        self._atts, self._attr, self._aval = s[b"ATTS"], s[b"ATTR"], s[b"AVAL"]
        self._unio, self._umem, self._uslt = s[b"UNIO"], s[b"UMEM"], s[b"USLT"]
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
        dicts = r["dict_row"][r["dict_row"] >= 0]
        if (r["dict_row"][dicts] >= 0).any():  # SAVE compresses against a template's own raw chunk
            raise FormatError("graph table index: a chunk's dictionary is itself compressed against "
                              "another chunk (a cycle?)")
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

    @cached_property
    def unions(self) -> list[UnionInfo]:
        """The union templates and their members, checked (`table_unions.read_unions`)."""
        return read_unions(self, self._unio, self._umem, self._uslt)

    def check_union_member(self, u: UnionInfo, m: int) -> None:
        """FormatError unless member m of union u matches its slots (`table_unions.check_member`)."""
        check_member(self, u, m)

    def is_union_row(self, row: int) -> bool:
        return bool(int(self.rows[row]["flags"]) & GRAPH_IS_UNION)

    def union_of(self, i: int) -> int:
        """The union graph i belongs to, -1 for none."""
        return int(self._umem[i]["union"]) if len(self._umem) else -1

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
        if off < 0 or n < 0 or off + n > len(self._strs):
            raise FormatError(f"graph table index: string {off}+{n} outside the {len(self._strs)}-byte pool")
        try:
            return self._strs[off:off + n].tobytes().decode()
        except UnicodeDecodeError as exc:
            raise FormatError(f"graph table index: string {off}+{n} is not UTF-8 ({exc.reason})") from None

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
        return {_type_name(int(t)): int(total[t]) for t in np.nonzero(total)[0]}

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
        if self.is_union_row(row):
            return f"union template (row {row})"
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
        raw = inflate(self._decompressor(dict_row), self.blob[off:off + chunk_len], chunk_raw,
                      f"{self._what(row)}: params", "index")
        try:
            s = unpack_container(raw, CHUNK_SECTIONS, "params")
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
            group = int(self.rows[ra]["group"])
            if depth or (group >= 0 and group == int(self.rows[rb]["group"])):
                # the index says they match (one group, or a child at the same node): damaged
                raise FormatError(f"graph table index: graph rows {ra} and {rb} share a template but "
                                  "not a topology")
            raise ValueError(f"graph rows {ra} and {rb} do not share a topology")
        diff = np.zeros(len(a.refs), dtype=bool)
        for t, ta, tb in ((_KERNEL, a.kpar, b.kpar), (_MEMSET, a.mset, b.mset), (_MEMCPY, a.mcpy, b.mcpy)):
            p = pos.get(t)
            if p is None or not len(p):
                continue
            xa, xb = ta[a.refs[p]], tb[b.refs[p]]
            d = np.zeros(len(p), dtype=bool)
            for n in ta.dtype.names or ():
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
