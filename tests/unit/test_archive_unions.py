"""Union templates in the graph table (format 1.1): written, read back, checked, and absent from 1.0."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard as zstd
from typer.testing import CliRunner

from ember.archive import bundle, graph_table, union
from ember.archive.graphs import Edge, MemcpyParams, Node, NodeType
from ember.archive.union import union_groups
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import LocalStore
from ember_testing.synthetic import synthetic_chains, synthetic_graphset, synthetic_images

Change = Callable[[dict[bytes, np.ndarray]], None]
MEMSETS_TOO = frozenset({NodeType.KERNEL, NodeType.MEMSET})  # EMBER_UNION_MEMSETS=1


def rewrite_index(blob: bytes, change: Change, minor: int = graph_table.MINOR) -> bytes:
    """The table with its index sections changed by `change` (and the header's minor set)."""
    _minor, _flags, ioff, ilen, iraw, coff = graph_table.read_header(blob)
    index = zstd.ZstdDecompressor().decompress(blob[ioff:ioff + ilen], max_output_size=iraw)
    sections = {k: np.array(v) for k, v in graph_table.unpack_container(
        index, graph_table.INDEX_SECTIONS, "index", graph_table.OPTIONAL_INDEX_SECTIONS).items()}
    change(sections)
    new_index = graph_table.pack_container(sections)
    frame = zstd.ZstdCompressor().compress(new_index)
    size = graph_table.OUTER.size
    header = graph_table.OUTER.pack(graph_table.MAGIC, graph_table.MAJOR, minor, size, 0, size, len(frame),
                                    len(new_index), size + len(frame))
    return header + frame + blob[coff:]


def test_unions_round_trip_beside_the_graphs_and_their_groups() -> None:
    gs = synthetic_chains()
    expected = union_groups(gs.graphs, gs.function_attrs)
    plain = graph_table.GraphTable(graph_table.encode(gs, unions=False))
    table = graph_table.GraphTable(graph_table.encode(gs, unions=True))
    assert table.version == "1.1"
    assert table.to_graphset().graphs == gs.graphs  # the roots are untouched
    assert [g.members for g in table.groups] == [g.members for g in plain.groups]
    assert plain.unions == []
    (u,) = table.unions
    assert u.members == expected[0].members
    assert [tuple(s.tolist()) for s in u.slots] == list(expected[0].slots)
    assert u.nodes == len(expected[0].graph.nodes)
    assert u.optional.tolist() == expected[0].optional()
    assert table.graph_of_row(u.row) == expected[0].graph
    assert table.is_union_row(u.row) and not table.is_union_row(int(table.roots[0]))
    assert [table.union_of(i) for i in range(table.count)] == [0] * table.count
    assert len(table.rows) == table.count + 1  # the template is a row of its own, not a root


def test_graphs_outside_any_union_say_so() -> None:
    gs = synthetic_graphset(graphs=4, nodes=60, groups=2)  # not chains
    table = graph_table.GraphTable(graph_table.encode(gs, unions=True))
    assert table.unions == [] and [table.union_of(i) for i in range(4)] == [-1] * 4


def test_the_writer_writes_unions_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    gs = synthetic_chains()
    monkeypatch.delenv("EMBER_UNION_TEMPLATES", raising=False)
    assert len(graph_table.GraphTable(graph_table.encode(gs)).unions) == 1
    monkeypatch.setenv("EMBER_UNION_TEMPLATES", "0")
    assert graph_table.GraphTable(graph_table.encode(gs)).unions == []


def test_a_table_without_union_sections_reads_as_before() -> None:
    """A 1.0 table has no UNIO/UMEM/USLT: it decodes, with no unions."""
    gs = synthetic_chains()

    def drop(sections: dict[bytes, np.ndarray]) -> None:
        for sid in graph_table.OPTIONAL_INDEX_SECTIONS:
            del sections[sid]

    table = graph_table.GraphTable(rewrite_index(graph_table.encode(gs, unions=False), drop, minor=0))
    assert table.version == "1.0" and table.unions == []
    assert table.to_graphset().graphs == gs.graphs


def _damaged(change: Change) -> graph_table.GraphTable:
    return graph_table.GraphTable(rewrite_index(graph_table.encode(synthetic_chains(), unions=True), change))


def _another_type(s: dict[bytes, np.ndarray]) -> None:
    """The last member's nodes from just after an optional slot up to its next memset move one slot
    back: still in order, but the memset lands in a kernel's slot."""
    gs = synthetic_chains()
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    m = len(u.members) - 1
    slots, nodes = list(u.slots[m]), gs.graphs[u.members[m]].nodes
    j = next(j for j in range(len(slots) - 1) if slots[j + 1] - slots[j] > 1)
    jm = next(k for k in range(j + 1, len(nodes)) if nodes[k].type == NodeType.MEMSET)
    moved = [slots[j] + 1, *slots[j + 1:jm]]
    off = int(s[b"UMEM"][u.members[m]][1])
    s[b"USLT"][off + j + 1:off + jm + 1] = moved


def _field(section: bytes, name: str, value: int) -> Change:
    def change(s: dict[bytes, np.ndarray]) -> None:
        s[section][name][0] = value

    return change


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s[b"USLT"].__setitem__(slice(0, 2), [5, 3]), "out of order"),
        (lambda s: s[b"USLT"].__setitem__(-1, 10_000), "out of range"),
        (_another_type, "node types differ"),
        (_field(b"UNIO", "graph", 0), "not a union template"),
        (_field(b"UMEM", "union", 7), "in union 7"),
        (lambda s: s.__setitem__(b"UMEM", s[b"UMEM"][:2]), "union entries"),
    ],
    ids=["out of order", "past the template", "another node type", "union names a root",
         "missing union", "memberships cut short"],
)
def test_damaged_union_sections_are_refused(change: Change, match: str) -> None:
    table = _damaged(change)
    with pytest.raises(graph_table.FormatError, match=match):
        _ = table.unions


def test_a_union_that_leaves_a_memset_out_reads_it_as_a_placeholder() -> None:
    gs = synthetic_chains(sizes=(1, 24, 32))  # 24 zeroes a workspace (6,144 bytes) the others do not
    (u,) = union.union_groups(gs.graphs, gs.function_attrs, optional=MEMSETS_TOO)
    assert u.members == (0, 1, 2)
    (info,) = graph_table.GraphTable(graph_table.encode(gs, unions=[u])).unions
    memsets = [s for s in info.optional.tolist() if u.graph.nodes[s].type == NodeType.MEMSET]
    assert memsets and info.placeholders.tolist() == memsets
    assert info.scratch_bytes == 64 * 24 * 4


@pytest.mark.parametrize("height, width", [(2, 16), (1, union.PLACEHOLDER_BYTES // 4 + 1)],
                         ids=["2-D", "too large"])
def test_a_memset_no_placeholder_can_stand_in_for_is_never_optional(
    monkeypatch: pytest.MonkeyPatch, height: int, width: int
) -> None:
    """Exec update cannot change a memset's dimensions, and the scratch is bounded."""
    gs = synthetic_chains(sizes=(1, 24, 32))
    for node in gs.graphs[1].nodes:
        if node.type == NodeType.MEMSET and node.params.width == 64 * 24:  # type: ignore[union-attr]
            node.params = dataclasses.replace(node.params, width=width, height=height)  # type: ignore[arg-type]
    ugs = union.union_groups(gs.graphs, gs.function_attrs, optional=MEMSETS_TOO)
    assert all(1 not in u.members for u in ugs)  # the planner keeps it an anchor ...
    monkeypatch.setattr(union, "placeable", lambda node: True)  # ... and a forged union is refused
    (u,) = union.union_groups(gs.graphs, gs.function_attrs, optional=MEMSETS_TOO)
    table = graph_table.GraphTable(graph_table.encode(gs, unions=[u]))
    with pytest.raises(graph_table.FormatError, match="no placeholder can stand in for"):
        _ = table.unions


def test_a_union_that_leaves_a_memcpy_out_of_a_member_is_refused() -> None:
    gs = synthetic_chains(sizes=(1, 32))
    extra = Node(NodeType.MEMCPY, MemcpyParams(0x7F00_0000_0000, 0x7F00_1000_0000, 64))
    g = gs.graphs[1]
    g.nodes.insert(3, extra)
    g.edges[:] = [Edge(i, i + 1) for i in range(len(g.nodes) - 1)]
    memcpys_too = frozenset({NodeType.KERNEL, NodeType.MEMCPY})  # no policy writes that: a forgery
    (u,) = union.union_groups(gs.graphs, gs.function_attrs, optional=memcpys_too)
    table = graph_table.GraphTable(graph_table.encode(gs, unions=[u]))
    with pytest.raises(graph_table.FormatError, match="leaves a memcpy node out"):
        _ = table.unions


def test_the_manifest_lists_the_unions_and_verify_compares_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_UNION_TEMPLATES", "1")
    store = LocalStore(tmp_path / "store")
    gs = synthetic_chains()
    identity = ArchiveIdentity(model="test/chains", engine="decode", engine_version="1", capture_sizes=(1, 2))
    compat = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580", cuda="13.0")
    result = bundle.write_archive(store, gs, identity, compat, kernel_images=synthetic_images())
    (u,) = result.manifest.graphs.unions
    assert u.keys == [list(g.key) for g in gs.graphs]
    assert u.nodes == len(union_groups(gs.graphs, gs.function_attrs)[0].graph.nodes) and u.optional > 0
    assert result.manifest.format_version == "1.2"
    assert bundle.verify_archive(store, identity.hash()) == []
    shown = CliRunner().invoke(app, ["inspect", (tmp_path / "store").as_uri()], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "1 union templates" in shown.output and "1, 2, 4, 8, 16" in shown.output
    raw = json.loads(store.get_manifest(identity.hash()) or b"")
    raw["graphs"]["unions"][0]["nodes"] += 1
    store.put_manifest(identity.hash(), json.dumps(raw).encode())
    problems = bundle.verify_archive(store, identity.hash())
    assert "union templates in the graph table differ" in " ".join(problems)


def test_members_match_their_slots_and_a_mismatch_is_refused() -> None:
    gs = synthetic_chains()
    table = graph_table.GraphTable(graph_table.encode(gs, unions=True))
    (u,) = table.unions
    for m in range(len(u.members)):
        table.check_union_member(u, m)  # every member as SAVE wrote it
    # A member whose GEMM has another cluster dimension than its slot's: exec update would keep
    # the old one (benchmarks/results/diag-cluster-update-H100-20261125.json).
    gs2 = synthetic_chains()
    node = next(n for n in gs2.graphs[0].nodes if n.params.attrs)  # type: ignore[union-attr]
    node.params.attrs = {4: bytes(64)}  # type: ignore[union-attr]
    unions = union_groups(gs.graphs, gs.function_attrs)
    forged = graph_table.GraphTable(graph_table.encode(gs2, unions=unions))
    with pytest.raises(graph_table.FormatError, match="does not match its union slot"):
        forged.check_union_member(forged.unions[0], 0)
