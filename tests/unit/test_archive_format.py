"""Graph table format: exact round trip, lazy decode, refusals of damaged or foreign tables."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from ember.archive import graph_table
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
from ember_testing.synthetic import synthetic_graphset


def small_set() -> GraphSet:
    """Every node type and field the model has, written out by hand."""
    child = Graph((), [
        Node(NodeType.KERNEL, KernelParams(1, (3, 1, 1), (64, 1, 1), 0, args=b"\x01" * 12,
                                           arg_offsets=(0, 8), arg_sizes=(8, 4))),
        Node(NodeType.MEMSET, MemsetParams(0x7000, 256, 0xDEADBEEF, 4, 64, 3)),
    ], [Edge(0, 1)])
    nodes = [
        Node(NodeType.KERNEL, KernelParams(0, (2**31 - 1, 65535, 3), (1024, 1, 1), 232448,
                                           args=struct.pack("<QQi", 0x7F0012340000, 2**64 - 1, -5),
                                           arg_offsets=(0, 8, 16), arg_sizes=(8, 8, 4),
                                           attrs={4: struct.pack("<3I", 2, 1, 1).ljust(64, b"\0"),
                                                  8: struct.pack("<i", -1).ljust(64, b"\0")})),
        Node(NodeType.KERNEL, KernelParams(1, (132, 1, 1), (384, 1, 1), 200704, extra=bytes(range(256)) * 7)),
        Node(NodeType.KERNEL, KernelParams(1, (1, 1, 1), (32, 1, 1), 0, extra=b"")),
        Node(NodeType.KERNEL, KernelParams(0, (1, 1, 1), (1, 1, 1), 0)),  # no arguments at all
        Node(NodeType.MEMSET, MemsetParams(0x7F0000000000, 0, 0, 1, 4096, 1)),
        Node(NodeType.MEMCPY, MemcpyParams(0x7F0000001000, 0x7F0000002000, 2**40)),
        Node(NodeType.EVENT_RECORD, EventParams(3)),
        Node(NodeType.WAIT_EVENT, EventParams(3)),
        Node(NodeType.EMPTY),
        Node(NodeType.GRAPH, child),
    ]
    edges = [Edge(0, 1, 0, 0, 1), Edge(1, 2), Edge(2, 3, 1, 2, 1), Edge(3, 4), Edge(4, 5), Edge(5, 6),
             Edge(6, 7), Edge(7, 8), Edge(8, 9), Edge(0, 9, 255, 255, 0)]
    g1 = Graph((1, 16), nodes, edges)
    g2 = Graph((2, -32), [Node(NodeType.EMPTY)], [])
    kernels = [KernelRef("ab" * 32, "_Z3fooPfi"), KernelRef("cd" * 32, "nvjet_hsh_128x64_ünïcode")]
    fattrs = [FunctionAttrs(49152, (2, 1, 1), 1, 50), FunctionAttrs()]
    return GraphSet([g1, g2], kernels, fattrs)


def test_round_trip_every_node_type_field_and_edge() -> None:
    gs = small_set()
    table = graph_table.GraphTable(graph_table.encode(gs))
    assert table.count == 2
    assert table.keys == [(1, 16), (2, -32)]
    assert table.version == graph_table.VERSION
    back = table.to_graphset()
    assert back.graphs == gs.graphs
    assert back.kernels == gs.kernels
    assert back.function_attrs == gs.function_attrs
    # Child graphs are rows of their own, not roots.
    assert len(table.rows) == 3
    assert table.node_type_counts()["GRAPH"] == 1
    assert table.node_total == 10 + 1 + 2


def test_synthetic_set_round_trips_and_shares_structure() -> None:
    gs = synthetic_graphset(graphs=12, nodes=150, groups=3)
    blob = graph_table.encode(gs)
    table = graph_table.GraphTable(blob)
    assert [g.members for g in table.groups] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    for i in (0, 5, 11):
        assert table.graph(i) == gs.graphs[i]
    assert table.graph_by_key((7,)) == gs.graphs[6]
    # Node types and edges are stored once per group, not once per graph.
    roots = table.rows[: table.count]
    assert len(set(roots["ntyp_off"].tolist())) == 3
    assert len(set(roots["edge_off"].tolist())) == 3
    # Members are compressed against their template: far smaller than the template's chunk.
    tmpl, member = table.rows[0], table.rows[1]
    assert member["dict_row"] == 0 and tmpl["dict_row"] == -1
    assert member["chunk_len"] < tmpl["chunk_len"] / 2


def test_open_decodes_no_chunk_until_asked() -> None:
    table = graph_table.GraphTable(graph_table.encode(synthetic_graphset(graphs=6, nodes=80, groups=2)))
    assert table._cache == {}
    _ = table.keys, table.groups, table.kernels, table.node_type_counts()
    assert table._cache == {}
    table.chunk(4)
    assert set(table._cache) >= {4}


def test_changed_nodes_finds_exactly_the_differing_params() -> None:
    gs = synthetic_graphset(graphs=4, nodes=60, groups=1)
    a = gs.graphs[1]
    b = Graph(a.key, list(a.nodes), a.edges)
    p = b.nodes[10].params
    assert isinstance(p, KernelParams)
    changed = KernelParams(p.kernel, p.grid, p.block, p.shared_mem + 16, args=p.args,
                           arg_offsets=p.arg_offsets, arg_sizes=p.arg_sizes, extra=p.extra, attrs=p.attrs)
    b.nodes[10] = Node(NodeType.KERNEL, changed)
    gs2 = GraphSet([a, b, gs.graphs[2]], gs.kernels, gs.function_attrs)
    table = graph_table.GraphTable(graph_table.encode(gs2))
    assert table.changed_nodes(1, 0).tolist() == [10]
    assert table.changed_nodes(0, 0).tolist() == []
    # Graphs of different batch sizes differ where the synthetic set puts the batch.
    diff = table.changed_nodes(2, 0)
    assert 0 < len(diff) < len(a.nodes)
    pairs = zip(gs.graphs[2].nodes, a.nodes, strict=True)
    want = [i for i, (x, y) in enumerate(pairs) if x.params != y.params]
    assert diff.tolist() == want
    # A switch decodes only those nodes.
    assert table.nodes(2, diff) == [gs.graphs[2].nodes[i] for i in want]
    assert table.nodes(2, []) == []
    with pytest.raises(IndexError):
        table.nodes(2, [len(a.nodes)])


@pytest.mark.parametrize("bad", [NodeType.HOST, NodeType.MEM_ALLOC, NodeType.CONDITIONAL])
def test_unrestorable_nodes_are_refused_by_name(bad: NodeType) -> None:
    gs = small_set()
    gs.graphs[0].nodes[4] = Node(bad)
    with pytest.raises(graph_table.UnsupportedNode) as err:
        graph_table.encode(gs)
    msg = str(err.value)
    assert "graph 0 (key (1, 16))" in msg and "node 4" in msg and bad.name in msg


def test_unrestorable_node_inside_a_child_graph_names_the_path() -> None:
    gs = small_set()
    child = gs.graphs[0].nodes[9].params
    assert isinstance(child, Graph)
    child.nodes.append(Node(NodeType.HOST))
    with pytest.raises(graph_table.UnsupportedNode, match=r"node 9 \(child graph\) node 2: HOST"):
        graph_table.encode(gs)


def test_bad_graph_contents_are_refused() -> None:
    gs = small_set()
    gs.graphs[1].edges.append(Edge(0, 5))
    with pytest.raises(graph_table.FormatError, match="edge names a node outside"):
        graph_table.encode(gs)
    gs = small_set()
    gs.graphs[0].nodes[0].params.kernel = 7  # type: ignore[union-attr]
    with pytest.raises(graph_table.UnsupportedNode, match="kernel index 7"):
        graph_table.encode(gs)


def test_truncated_table_is_refused_with_a_clear_error() -> None:
    blob = graph_table.encode(small_set())
    with pytest.raises(graph_table.FormatError, match="truncated"):
        graph_table.GraphTable(blob[:20])
    with pytest.raises(graph_table.FormatError, match="truncated"):
        graph_table.GraphTable(blob[:-7])


def test_bit_flip_in_a_chunk_is_detected() -> None:
    gs = synthetic_graphset(graphs=4, nodes=60, groups=1)
    blob = bytearray(graph_table.encode(gs))
    table = graph_table.GraphTable(bytes(blob))
    row = table.rows[2]
    pos = table._chunks_off + int(row["chunk_off"]) + int(row["chunk_len"]) // 2
    blob[pos] ^= 0x40
    damaged = graph_table.GraphTable(bytes(blob))
    with pytest.raises(graph_table.FormatError, match=r"graph \(3,\)"):
        damaged.graph(2)  # zstd's frame checksum or our structure checks catch it


def test_foreign_magic_zstd_and_major_version_are_refused() -> None:
    blob = graph_table.encode(small_set())
    with pytest.raises(graph_table.FormatError, match="not an ember graph table"):
        graph_table.GraphTable(b"XXXX" + blob[4:])
    with pytest.raises(graph_table.FormatError, match="zstd frame"):
        graph_table.GraphTable(b"\x28\xb5\x2f\xfd" + blob[4:])
    newer = bytearray(blob)
    struct.pack_into("<H", newer, 4, graph_table.MAJOR + 1)
    with pytest.raises(graph_table.FormatVersionError, match=r"format 2\.\d+ .*upgrade ember"):
        graph_table.GraphTable(bytes(newer))


def test_newer_minor_with_extra_sections_and_wider_rows_is_read() -> None:
    """A minor version may append row fields and add sections; this reader keeps what it knows."""
    gs = small_set()
    blob = graph_table.encode(gs)
    _minor, _flags, ioff, ilen, iraw, coff = graph_table.read_header(blob)
    import zstandard as zstd

    index = zstd.ZstdDecompressor().decompress(blob[ioff:ioff + ilen], max_output_size=iraw)
    sections = graph_table.unpack_container(index, graph_table.INDEX_SECTIONS, "index")
    # Rebuild the index with GRPH rows 8 bytes wider and an unknown section.
    names = list(graph_table.GRPH_DT.names)
    wide = np.dtype({"names": [*names, "future"],
                     "formats": [graph_table.GRPH_DT.fields[n][0] for n in names] + ["<u8"],
                     "offsets": [graph_table.GRPH_DT.fields[n][1] for n in names]
                                + [graph_table.GRPH_DT.itemsize],
                     "itemsize": graph_table.GRPH_DT.itemsize + 8})
    grph = np.zeros(len(sections[b"GRPH"]), dtype=wide)
    for n in graph_table.GRPH_DT.names:
        grph[n] = sections[b"GRPH"][n]
    grph["future"] = 0xFEEDFACE
    parts = {sid: (np.array(v) if sid != b"GRPH" else grph) for sid, v in sections.items()}
    parts[b"ZZZZ"] = b"something a later minor adds"
    new_index = graph_table.pack_container(parts)
    frame = zstd.ZstdCompressor().compress(new_index)
    chunks = blob[coff:]
    size = graph_table.OUTER.size
    header = graph_table.OUTER.pack(graph_table.MAGIC, graph_table.MAJOR, graph_table.MINOR + 3, size, 0,
                                    size, len(frame), len(new_index), size + len(frame))
    table = graph_table.GraphTable(header + frame + chunks)
    assert table.version == f"{graph_table.MAJOR}.{graph_table.MINOR + 3}"
    assert table.to_graphset().graphs == gs.graphs


def test_index_pointing_outside_its_pools_is_refused() -> None:
    gs = small_set()
    blob = graph_table.encode(gs)
    _minor, _flags, ioff, ilen, iraw, coff = graph_table.read_header(blob)
    import zstandard as zstd

    index = zstd.ZstdDecompressor().decompress(blob[ioff:ioff + ilen], max_output_size=iraw)
    sections = {k: np.array(v)
                for k, v in graph_table.unpack_container(index, graph_table.INDEX_SECTIONS, "i").items()}
    sections[b"GRPH"]["node_count"][0] = 10_000
    new_index = graph_table.pack_container(sections)
    frame = zstd.ZstdCompressor().compress(new_index)
    size = graph_table.OUTER.size
    header = graph_table.OUTER.pack(graph_table.MAGIC, graph_table.MAJOR, graph_table.MINOR, size, 0, size,
                                    len(frame), len(new_index), size + len(frame))
    with pytest.raises(graph_table.FormatError, match="outside the key/node/edge pools"):
        graph_table.GraphTable(header + frame + blob[coff:])


def test_open_is_cheap_for_many_graphs() -> None:
    """Loose check only; real numbers come from `ember bench parse` (ember_bench.parse.parse_ms_512)."""
    blob = graph_table.encode(synthetic_graphset(graphs=128, nodes=300, groups=4))
    t = time.perf_counter()
    table = graph_table.GraphTable(blob)
    for g in table.groups:
        table.chunk(g.template)
    _ = table.keys
    elapsed = time.perf_counter() - t
    assert table.count == 128
    assert elapsed < 0.5, f"opening 128 graphs took {elapsed * 1e3:.0f} ms"


def test_empty_sets_and_graphs_round_trip() -> None:
    empty = graph_table.GraphTable(graph_table.encode(GraphSet([], [], [])))
    assert (empty.count, empty.keys, empty.groups, empty.node_type_counts()) == (0, [], [], {})
    empty.validate()
    gs = GraphSet([Graph((1,), [], [])], [], [])
    assert graph_table.GraphTable(graph_table.encode(gs)).to_graphset() == gs


@pytest.mark.parametrize("graph", [
    Graph((1,), [Node(NodeType.EMPTY), Node(NodeType.EMPTY)], [Edge(0, 1, 0, 0, 300)]),
    Graph((2**63,), [], []),
    Graph((1,), [Node(NodeType.KERNEL, KernelParams(0, (2**32, 1, 1), (1, 1, 1), 0))], []),
    Graph((1,), [Node(NodeType.MEMSET, MemsetParams(-1, 0, 0, 4, 1, 1))], []),
])
def test_values_that_do_not_fit_their_field_are_refused(graph: Graph) -> None:
    with pytest.raises(graph_table.FormatError, match="does not fit"):
        graph_table.encode(GraphSet([graph], [KernelRef("a" * 64, "k")], []))


def test_a_graph_in_words_names_its_kernels_and_copy_sizes() -> None:
    from ember.archive.graph_summary import graph_nodes

    words = graph_nodes(small_set(), (1, 16))
    assert words[0] == "_Z3fooPfi grid=(2147483647, 65535, 3) block=(1024, 1, 1)"
    assert words[1].startswith("nvjet_hsh_128x64_ünïcode grid=(132, 1, 1)")
    assert words[4:10] == ["memset 4096 B", f"memcpy {2**40} B", "EVENT_RECORD", "WAIT_EVENT", "EMPTY",
                           "GRAPH"]
    assert graph_nodes(small_set(), (2, -32)) == ["EMPTY"]
    assert graph_nodes(small_set(), (9,)) == []  # a key the set does not hold
    assert len(graph_nodes(small_set(), (1, 16), limit=3)) == 3
