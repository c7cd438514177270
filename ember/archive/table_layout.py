"""The graph table's binary layout: version, header and section structs, row dtypes, errors, and
the section container both the encoder (ember/archive/table_encoder.py) and the decoder
(ember/archive/table_decoder.py) use. The byte-level spec is docs/archive-format.md.

Row layouts and section ids are part of the format: fields are appended only, and a reader takes
the fields it knows from rows a newer minor made wider (`unpack_container`).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ember.archive.graphs import NodeType

MAGIC = b"EMGT"
MAJOR = 1
MINOR = 1  # 1.1 added union templates (GRAPH_IS_UNION rows, UNIO/UMEM/USLT)
VERSION = f"{MAJOR}.{MINOR}"
NONE = 0xFFFFFFFF
DEFAULT_LEVEL = 3

OUTER = struct.Struct("<4sHHIIQQQQ")  # magic, major, minor, header_size, flags, index off/len/raw, chunks
CONTAINER = struct.Struct("<II")  # section count, reserved
SECTION = struct.Struct("<4sIQQQ")  # id, row size, row count, offset, length

SERIALIZABLE = frozenset(
    {NodeType.KERNEL, NodeType.MEMCPY, NodeType.MEMSET, NodeType.GRAPH, NodeType.EMPTY,
     NodeType.WAIT_EVENT, NodeType.EVENT_RECORD}
)  # node types an archive can hold

# Row layouts (packed, little-endian). Field order is part of the format: append only.
GRPH_DT = np.dtype([
    ("key_off", "<u4"), ("key_len", "<u4"), ("ntyp_off", "<u4"), ("node_count", "<u4"),
    ("edge_off", "<u4"), ("edge_count", "<u4"), ("group", "<i4"), ("flags", "<u4"),
    ("chunk_off", "<u8"), ("chunk_len", "<u4"), ("chunk_raw", "<u4"), ("dict_row", "<i4"),
    ("reserved", "<u4"),
])
GRAPH_IS_CHILD = 1
GRAPH_IS_UNION = 2  # a union template (ember.archive.union): neither a root nor a child
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
UNIO_DT = np.dtype([("graph", "<u4"), ("reserved", "<u4")])  # per union: its template's GRPH row
UMEM_DT = np.dtype([("union", "<i4"), ("slots_off", "<u4")])  # per root: its union (-1: none)
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
    b"UNIO": UNIO_DT, b"UMEM": UMEM_DT, b"USLT": U32,
}
OPTIONAL_INDEX_SECTIONS = frozenset({b"UNIO", b"UMEM", b"USLT"})  # absent from 1.0 tables
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


# Section containers: a directory of (id, row size, row count, offset, length), then the sections,
# each 8-byte aligned.


def pack_container(sections: dict[bytes, np.ndarray | bytes]) -> bytes:
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
    fields = dt.fields
    if dt.names is None or fields is None:
        raise FormatError(f"row size {row} for a scalar section of {dt.itemsize}-byte items")
    if row > MAX_ROW:  # numpy takes an item size up to a C int only
        raise FormatError(f"row size {row} is past {MAX_ROW} bytes")
    return np.dtype({"names": list(dt.names), "formats": [fields[n][0] for n in dt.names],
                     "offsets": [fields[n][1] for n in dt.names], "itemsize": row})


MAX_ROW = 1 << 16  # a newer minor may grow rows, not by this much


def unpack_container(buf: bytes | memoryview, known: dict[bytes, np.dtype], what: str,
                     optional: frozenset[bytes] = frozenset()) -> dict[bytes, Any]:
    """The known sections of a container (numpy views); an `optional` one that is absent comes
    back empty, any other that is absent is a FormatError."""
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
    for sid in optional - out.keys():
        out[sid] = np.zeros(0, dtype=known[sid])
    missing = [s.decode() for s in known if s not in out]
    if missing:
        raise FormatError(f"{what}: sections missing: {', '.join(missing)}")
    return out
