"""Union templates (ember.archive.union): one chain holding every node of several chains."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest

from ember.archive.graphs import Edge, EventParams, Graph, Node, NodeType
from ember.archive.topology import group_graphs, node_class
from ember.archive.union import anchored_supersequence, not_a_chain, supersequence, union_groups
from ember_testing.synthetic import synthetic_chains, synthetic_graphset


def lcs_length(a: list[int], b: list[int]) -> int:
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, j in itertools.product(range(len(a)), range(len(b))):
        t[i + 1][j + 1] = t[i][j] + 1 if a[i] == b[j] else max(t[i][j + 1], t[i + 1][j])
    return t[len(a)][len(b)]


def is_embedding(seq: list[int], merged: list[int], where: list[int]) -> bool:
    increasing = all(x < y for x, y in itertools.pairwise(where))
    return len(where) == len(seq) and increasing and [merged[s] for s in where] == seq


@pytest.mark.parametrize("seed", range(40))
def test_supersequence_is_shortest_and_holds_both(seed: int) -> None:
    rng = random.Random(seed)
    a = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
    b = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
    found = supersequence(a, b)
    assert found is not None
    merged, amap, bmap = found
    assert is_embedding(a, merged, amap)
    assert is_embedding(b, merged, bmap)
    assert len(merged) == len(a) + len(b) - lcs_length(a, b)


def test_supersequence_gives_up_past_its_edit_budget() -> None:
    a, b = [1] * 50, [2] * 50  # 100 edits apart
    assert supersequence(a, b, max_edits=99) is None
    found = supersequence(a, b, max_edits=100)
    assert found is not None and len(found[0]) == 100


@pytest.mark.parametrize("seed", range(40))
def test_an_anchored_supersequence_shares_every_anchor(seed: int) -> None:
    rng = random.Random(seed)
    anchors = [rng.choice((7, 8)) for _ in range(rng.randrange(0, 4))]

    def around(marks: list[int]) -> tuple[list[int], list[list[int]]]:
        parts = [[rng.randrange(3) for _ in range(rng.randrange(0, 8))] for _ in range(len(marks) + 1)]
        seq = list(parts[0])
        for mark, part in zip(marks, parts[1:], strict=True):
            seq += [mark, *part]
        return seq, parts

    (a, pa), (b, pb) = around(anchors), around(anchors)
    found = anchored_supersequence(a, b, {7, 8})
    assert found is not None
    merged, amap, bmap = found
    assert is_embedding(a, merged, amap) and is_embedding(b, merged, bmap)
    shared = set(amap) & set(bmap)
    assert all(s in shared for s, t in enumerate(merged) if t in (7, 8))  # no anchor is optional
    assert len(merged) == len(anchors) + sum(
        len(x) + len(y) - lcs_length(x, y) for x, y in zip(pa, pb, strict=True))  # shortest such
    if anchors:
        assert anchored_supersequence(a, [*b, anchors[0]], {7, 8}) is None  # anchors differ
        assert anchored_supersequence(a, b, {7, 8}, max_edits=-1) is None


def test_members_share_every_memset_and_one_with_another_memset_stays_out() -> None:
    gs = synthetic_chains(sizes=(1, 24, 32, 64))  # 24 zeroes a workspace the others do not
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    assert u.members == (0, 2, 3)
    optional = u.optional()
    assert optional and all(u.graph.nodes[s].type == NodeType.KERNEL for s in optional)
    assert any(n.type == NodeType.MEMSET for n in u.graph.nodes)  # the memsets all share


def test_with_memsets_optional_a_member_may_lack_a_1d_memset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_UNION_MEMSETS", "1")  # LOAD runs a placeholder into scratch there
    gs = synthetic_chains(sizes=(1, 24, 32, 64))
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    assert u.members == (0, 1, 2, 3)
    lacked = [s for s in u.optional() if u.graph.nodes[s].type == NodeType.MEMSET]
    assert lacked and all(s in u.slots[1] for s in lacked)  # size 24's workspace memsets
    shared = [s for s, n in enumerate(u.graph.nodes) if n.type == NodeType.MEMSET and s not in lacked]
    assert shared and all(s in run for run in u.slots for s in shared)  # the attention memsets


PDL = (1, 0, 1)  # from the kernel's programmatic port, programmatic dependency


def with_pdl(gs: Any, into: dict[str, Callable[[int], bool]]) -> Any:
    """Programmatic edges into the kernels named in `into`, for the sizes its test accepts."""
    for g in gs.graphs:
        for j, e in enumerate(g.edges):
            node = g.nodes[e.dst]
            name = gs.kernels[node.params.kernel].name if node.type == NodeType.KERNEL else ""
            if any(k in name and test(g.key[0]) for k, test in into.items()):
                g.edges[j] = Edge(e.src, e.dst, *PDL)
    return gs


def test_chains_with_programmatic_edges_join_only_when_asked() -> None:
    gs = with_pdl(synthetic_chains(), {"qkv": lambda b: b >= 32})
    (u,) = union_groups(gs.graphs, gs.function_attrs, programmatic=False)
    assert u.members == (0, 1, 2, 3, 4)  # sizes 32, 48, 64 have programmatic edges
    (u,) = union_groups(gs.graphs, gs.function_attrs, programmatic=True)
    assert u.members == tuple(range(len(gs.graphs)))


def test_a_union_keeps_a_programmatic_edge_only_where_every_member_has_it() -> None:
    everyone = lambda b: True  # noqa: E731
    # rope -> cache: every member, common slots; act -> mul: only some sizes; oproj -> reduce and
    # the GEMMs: slots some members lack (reduce below 8, the GEMMs' cluster dimensions)
    gs = with_pdl(synthetic_chains(), {"cache": everyone, "mul": lambda b: b >= 32, "reduce": everyone,
                                       "qkv": everyone})
    (u,) = union_groups(gs.graphs, gs.function_attrs, programmatic=True)
    kept = {(e.src, e.dst) for e in u.graph.edges if (e.from_port, e.to_port, e.type) == PDL}
    assert all((e.from_port, e.to_port, e.type) in (PDL, (0, 0, 0)) for e in u.graph.edges)
    for s in range(len(u.graph.nodes) - 1):  # the rule, edge by edge
        datas = set()
        for m, run in zip(u.members, u.slots, strict=True):
            j = run.index(s) if s in run else -1
            if j < 0 or j + 1 >= len(run) or run[j + 1] != s + 1:
                datas.add(None)  # a member without both slots: default
            else:
                e = gs.graphs[m].edges[j]
                datas.add((e.from_port, e.to_port, e.type))
        assert ((s, s + 1) in kept) is (datas == {PDL}), s

    def into(name: str) -> int:
        return sum(name in gs.kernels[u.graph.nodes[d].params.kernel].name for _, d in kept)

    assert into("cache") == 4 and len(kept) == 4  # one per layer; mul, reduce and qkv none


def test_only_chains_of_disableable_nodes_qualify() -> None:
    gs = synthetic_chains(sizes=(1, 8))
    assert not_a_chain(gs.graphs[0]) == ""
    forked = synthetic_chains(sizes=(1,)).graphs[0]
    forked.edges.append(Edge(0, 2))
    assert "not a chain" in not_a_chain(forked)
    programmatic = synthetic_chains(sizes=(1,)).graphs[0]
    programmatic.edges[3] = Edge(3, 4, 0, 0, 1)
    assert "type 1" in not_a_chain(programmatic)
    assert not_a_chain(programmatic, programmatic=True) == ""
    shuffled = synthetic_chains(sizes=(1,)).graphs[0]
    shuffled.edges[0], shuffled.edges[1] = shuffled.edges[1], shuffled.edges[0]
    assert "not a chain" in not_a_chain(shuffled)
    evented = synthetic_chains(sizes=(1,)).graphs[0]
    evented.nodes[2] = Node(NodeType.EVENT_RECORD, EventParams(0))
    assert "EVENT_RECORD" in not_a_chain(evented)
    assert not_a_chain(Graph((1,), [], [])) == "no nodes"


def test_a_union_holds_every_member_in_its_slots() -> None:
    gs = synthetic_chains()
    groups = group_graphs(gs.graphs, gs.function_attrs)
    assert len(groups) > 2  # the sizes differ in topology: several templates without a union
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    assert u.members == tuple(range(len(gs.graphs)))
    fa = gs.function_attrs
    union_classes = [node_class(n, fa) for n in u.graph.nodes]
    for m, slots in zip(u.members, u.slots, strict=True):
        g = gs.graphs[m]
        assert is_embedding([node_class(n, fa) for n in g.nodes], union_classes, list(slots))  # type: ignore[arg-type]
    assert u.graph.edges == [Edge(i, i + 1) for i in range(len(u.graph.nodes) - 1)]
    assert len(u.graph.nodes) < sum(len(gs.graphs[grp.template].nodes) for grp in groups)
    assert 0 < len(u.optional()) < len(u.graph.nodes)


def test_the_template_takes_each_slot_from_its_first_member() -> None:
    gs = synthetic_chains()
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    first = {}
    for m, slots in zip(u.members, u.slots, strict=True):
        for j, s in enumerate(slots):
            first.setdefault(s, (m, j))
    for s, node in enumerate(u.graph.nodes):
        m, j = first[s]
        assert node == gs.graphs[m].nodes[j]
        assert node is not gs.graphs[m].nodes[j]  # a copy: the template owns its nodes


def test_members_of_one_topology_share_slots_and_a_lone_topology_makes_no_union() -> None:
    gs = synthetic_chains(sizes=(1, 2, 4))  # one topology
    assert len(group_graphs(gs.graphs, gs.function_attrs)) == 1
    assert union_groups(gs.graphs, gs.function_attrs) == []
    gs = synthetic_chains(sizes=(1, 2, 32, 64))
    (u,) = union_groups(gs.graphs, gs.function_attrs)
    assert u.slots[0] == u.slots[1] and u.slots[2] == u.slots[3] and u.slots[0] != u.slots[2]


def test_the_growth_cap_splits_unions() -> None:
    gs = synthetic_chains()
    (whole,) = union_groups(gs.graphs, gs.function_attrs)
    longest = max(len(g.nodes) for g in gs.graphs)
    cap = (len(whole.graph.nodes) - 1) / longest
    parts = union_groups(gs.graphs, gs.function_attrs, max_growth=cap)
    assert parts and all(len(p.graph.nodes) <= cap * longest for p in parts)
    assert [p.members for p in parts] != [whole.members]
    covered = [m for p in parts for m in p.members]
    assert len(covered) == len(set(covered))  # a graph joins one union at most


def test_graphs_that_are_not_chains_stay_out() -> None:
    gs = synthetic_graphset(graphs=6, nodes=80, groups=2)  # event and child-graph nodes
    assert union_groups(gs.graphs, gs.function_attrs) == []


def test_the_merge_order_puts_the_first_needed_members_nodes_first() -> None:
    gs = synthetic_chains(sizes=(1, 32))
    (a,) = union_groups(gs.graphs, gs.function_attrs, order=[0, 1])
    (b,) = union_groups(gs.graphs, gs.function_attrs, order=[1, 0])
    assert a.members == b.members == (0, 1)  # members keep input order
    assert a.graph.nodes[0] == gs.graphs[0].nodes[0] and b.graph.nodes[0] == gs.graphs[1].nodes[0]
    assert a.slots[0] == tuple(sorted(a.slots[0]))


def test_the_what_if_diag_counts_templates_per_policy() -> None:
    from ember_bench import union_whatif as whatif

    # 24 zeroes a workspace the others do not; 48 and 64 have programmatic edges
    gs = with_pdl(synthetic_chains(sizes=(1, 8, 24, 32, 48, 64)), {"qkv": lambda b: b >= 48})
    groups = len(group_graphs(gs.graphs, gs.function_attrs))
    got = {name: whatif.plan(list(gs.graphs), gs.function_attrs, **policy)
           for name, policy in whatif.POLICIES.items()}
    default, prog, memsets = got["default"], got["programmatic"], got["programmatic, memsets"]
    assert default["topology_groups"] == groups and len(default["unions"]) == 1
    assert default["left_out_because"] == {"programmatic edges": 2, "did not merge": 1}
    assert prog["left_out_because"] == {"did not merge": 1}
    assert prog["templates"] < default["templates"] and memsets["templates"] == 1
    (u,) = memsets["unions"]
    assert len(u["members"]) == 6 and u["optional_slots"] > u["placeholders"] > 0
    assert all(v["placeholders"] == 0 for v in prog["unions"])
