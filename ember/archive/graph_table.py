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

This module is the public entry; the code sits in three modules next to it: `table_layout`
(version, structs, row dtypes, errors, section containers), `table_encoder` (`encode`) and
`table_decoder` (`GraphTable`, `decode`).

Versioning: a reader refuses another MAJOR (`FormatVersionError`); for a newer MINOR it reads
the sections and row fields it knows: unknown sections are skipped and rows may grow at the end
(each section records its row size).
"""

from ember.archive.table_decoder import GraphChunk, GraphTable, GroupInfo, UnionInfo, decode, read_header
from ember.archive.table_encoder import encode, unions_by_default
from ember.archive.table_layout import (
    CHUNK_SECTIONS,
    DEFAULT_LEVEL,
    GRAPH_IS_CHILD,
    GRAPH_IS_UNION,
    GRPH_DT,
    INDEX_SECTIONS,
    KPAR_DT,
    KPAR_EXTRA,
    MAGIC,
    MAJOR,
    MINOR,
    NONE,
    OPTIONAL_INDEX_SECTIONS,
    OUTER,
    SERIALIZABLE,
    VERSION,
    FormatError,
    FormatVersionError,
    UnsupportedNode,
    pack_container,
    unpack_container,
)

__all__ = [
    "CHUNK_SECTIONS",
    "DEFAULT_LEVEL",
    "GRAPH_IS_CHILD",
    "GRAPH_IS_UNION",
    "GRPH_DT",
    "INDEX_SECTIONS",
    "KPAR_DT",
    "KPAR_EXTRA",
    "MAGIC",
    "MAJOR",
    "MINOR",
    "NONE",
    "OPTIONAL_INDEX_SECTIONS",
    "OUTER",
    "SERIALIZABLE",
    "VERSION",
    "FormatError",
    "FormatVersionError",
    "GraphChunk",
    "GraphTable",
    "GroupInfo",
    "UnionInfo",
    "UnsupportedNode",
    "decode",
    "encode",
    "pack_container",
    "read_header",
    "unions_by_default",
    "unpack_container",
]
