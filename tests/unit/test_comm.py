"""CPU: multi-GPU archives from one GPU. The stub's placeholders become the archive's collective
table (deduplicated, per graph, SPMD-checked), survive the manifest's JSON, turn into splice ops
in prepared graphs (both the table fast path and the object path) and into child-graph nodes for
libember's builder; topology groups split by the shapes of this rank's collectives; parallel
shapes are validated; SAVE preloads the stub only when asked."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("cuda.bindings")

from ember import native
from ember.archive import graph_table
from ember.archive.graphs import Edge, Graph, GraphSet, MemsetParams, Node, NodeType
from ember.engines.decode.parallel import Parallel
from ember.runtime import comm, session
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.build_native import _describe
from ember.runtime.graphs.groups import Group, split_groups
from ember.runtime.graphs.prepared import OP_CHILD, OP_MEMSET, OP_SPLICE, arrays_of, mark_splices, ops_of

SCRATCH = 0x7F00_0000_1000


def _call(
    seq: int, op: str = "all_reduce", count: int = 4096, peer: int = -1, nranks: int = 2
) -> dict[str, Any]:
    return {"seq": seq, "op": op, "send": 0x6000_0000_0000, "recv": 0x6000_0000_0000, "count": count,
            "dtype": 9, "redop": 0 if op == "all_reduce" else -1, "root": peer, "comm": 0, "nranks": nranks,
            "rank": 0, "stream": 1}


def _memset(dst: int, value: int) -> Node:
    return Node(NodeType.MEMSET, MemsetParams(dst, 0, value, 4, 1, 1))


def _graph(key: int, values: list[int]) -> Graph:
    """empty → placeholder → real memset → placeholder ..., chained."""
    nodes = [Node(NodeType.EMPTY)]
    for v in values:
        nodes += [_memset(SCRATCH, v), _memset(0x6000_0000_2000, 0)]
    edges = [Edge(i, i + 1) for i in range(len(nodes) - 1)]
    return Graph(key=(key,), nodes=nodes, edges=edges)


def _table() -> tuple[GraphSet, comm.Collectives]:
    # Graph 1 and 2 both run seq 1's call shape (deduplicated); graph 2 has a second one.
    gs = GraphSet(graphs=[_graph(1, [1]), _graph(2, [2, 3])], kernels=[], function_attrs=[])
    by_seq = {1: [_call(1)], 2: [_call(2)], 3: [_call(3, "all_gather", 128)]}
    table = comm.placeholders(gs, SCRATCH, by_seq, world=2, nccl_version="2.28.9")
    assert table is not None
    return gs, table


def test_placeholders_become_a_deduplicated_table() -> None:
    _, t = _table()
    assert t.world == 2 and t.placeholders == 3
    assert [c[0].op for c in t.table] == ["all_reduce", "all_gather"]
    assert t.nodes == {0: [(1, 0)], 1: [(1, 0), (3, 1)]}  # the real memsets are left alone
    assert comm.Collectives.from_facts(json.loads(json.dumps(t.to_facts()))) == t
    assert t.summary()[0].startswith("#0: all_reduce sum 4096 x bfloat16 (2 nodes)")


def test_no_placeholder_means_no_table() -> None:
    gs = GraphSet(graphs=[_graph(1, [])], kernels=[], function_attrs=[])
    assert comm.placeholders(gs, SCRATCH, {}, world=1, nccl_version="") is None


@pytest.mark.parametrize(
    ("by_seq", "message"),
    [
        ({}, "has no recorded call"),
        ({1: [_call(1, nranks=4)]}, "communicator of 4 ranks"),
        ({1: [_call(1, "send", peer=1)]}, "rank-specific"),
        ({1: [_call(1, "teleport")]}, "unknown NCCL call"),
    ],
)
def test_placeholders_that_cannot_serve_every_rank_are_refused(by_seq: dict, message: str) -> None:
    gs = GraphSet(graphs=[_graph(1, [1])], kernels=[], function_attrs=[])
    with pytest.raises(comm.PlaceholderError, match=message):
        comm.placeholders(gs, SCRATCH, by_seq, world=2, nccl_version="")


def test_a_group_exchanging_with_every_rank_is_one_placeholder() -> None:
    calls = [_call(1, op, 16, peer) for peer in range(2) for op in ("send", "recv")]
    gs = GraphSet(graphs=[_graph(1, [1])], kernels=[], function_attrs=[])
    t = comm.placeholders(gs, SCRATCH, {1: calls}, world=2, nccl_version="")
    assert t is not None and len(t.table) == 1 and len(t.table[0]) == 4


def test_placeholder_inside_a_child_graph_is_refused() -> None:
    child = _graph(0, [1])
    gs = GraphSet(graphs=[Graph((1,), [Node(NodeType.GRAPH, child)], [])], kernels=[], function_attrs=[])
    with pytest.raises(comm.PlaceholderError, match="child graph"):
        comm.placeholders(gs, SCRATCH, {1: [_call(1)]}, world=2, nccl_version="")


def test_splices_replace_placeholders_on_both_preparation_paths() -> None:
    gs, t = _table()
    table = graph_table.decode(graph_table.encode(gs))
    fast = rebuild.prepare_from_table(table, 1, [], None, rebuild.AttrSets(table))
    slow = rebuild.prepare(gs.graphs[1], [], None)
    for prep in (fast, slow):
        mark_splices(prep, t.nodes[1])
        ops = ops_of(prep) if prep.arrays is None else None
        arrays = arrays_of(prep)
        assert arrays is not None
        assert arrays.codes.tolist() == [3, OP_SPLICE, OP_MEMSET, OP_SPLICE, OP_MEMSET]
        assert arrays.args[1] == 0 and arrays.args[3] == 1
        if ops is not None:
            assert ops[1] == (OP_SPLICE, 0) and ops[3] == (OP_SPLICE, 1)


def test_builder_gets_child_graphs_and_refuses_without_a_communicator() -> None:
    gs, t = _table()
    prep = rebuild.prepare(gs.graphs[1], [], None)
    mark_splices(prep, t.nodes[1])
    arrays = arrays_of(prep)
    assert arrays is not None
    graphs = {0: 0xAAA0, 1: 0xBBB0}
    d = native.GraphDesc()
    keep = _describe(d, prep, arrays, events={}, splices=graphs.__getitem__)
    args, codes = keep[0], keep[1]
    assert d.ops == codes.ctypes.data and d.args == args.ctypes.data
    assert codes.tolist() == [3, OP_CHILD, OP_MEMSET, OP_CHILD, OP_MEMSET]
    assert args[1] == 0xAAA0 and args[3] == 0xBBB0
    assert arrays.codes[1] == OP_SPLICE  # the prepared graph itself is unchanged
    with pytest.raises(rebuild.RebuildError, match="no communicator"):
        _describe(native.GraphDesc(), prep, arrays, events={}, splices=None)


def test_groups_split_by_the_shapes_of_this_ranks_collectives() -> None:
    groups = [Group(0, [0, 1, 2, 3], 1), Group(1, [4], 4)]
    spliced = {0: [(1, 0)], 1: [(1, 1)], 2: [(1, 1)], 3: [(1, 0)]}
    shapes = {0: (0,), 1: (0, 7)}  # collective 1 came out as kernel + event record here
    out = split_groups(groups, spliced, shapes.__getitem__)
    assert [(g.members, g.template) for g in out] == [([0, 3], 0), ([1, 2], 1), ([4], 4)]
    assert [g.index for g in out] == [0, 1, 2]
    same = split_groups(groups, spliced, lambda i: (0,))
    assert [(g.members, g.template) for g in same] == [([0, 1, 2, 3], 1), ([4], 4)]


def _spec(**kw: Any) -> Any:
    base = {"name": "x", "heads": 32, "kv_heads": 8, "inter": 1024, "experts": 0}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("par", "spec", "message"),
    [
        (Parallel(tensor=3), _spec(), "heads=32 does not split"),
        (Parallel(tensor=16), _spec(), "kv_heads=8 does not split"),
        (Parallel(data=2, expert=2), _spec(), "no experts"),
        (Parallel(tensor=2, expert=2), _spec(experts=8), "split experts"),
        (Parallel(data=4, expert=2), _spec(experts=8), "must be 1 or tensor x data = 4"),
        (Parallel(data=2, expert=2), _spec(experts=7), "do not split"),
        (Parallel(tensor=2, rank=2), _spec(), "bad parallel shape"),
    ],
)
def test_bad_parallel_shapes_are_refused(par: Parallel, spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        par.validate(spec)


def test_good_parallel_shapes() -> None:
    Parallel(tensor=2).validate(_spec())
    Parallel(data=2, expert=2, rank=1).validate(_spec(experts=8))
    assert Parallel(tensor=2, data=2).world == 4 and not Parallel().active
    assert Parallel(collectives=True).active and Parallel(data=2).active
    assert Parallel(tensor=2, rank=1).degrees() == Parallel(tensor=2).degrees()  # rank is not stored


def test_save_preloads_the_stub_after_libember_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    lib = tmp_path / "libember.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(native, "find_library", lambda: lib)
    env = {"LD_PRELOAD": "/x/libother.so"}
    with pytest.raises(FileNotFoundError, match="libember_nccl"):
        session.preload_env("save", env, comm_stub=True)
    (tmp_path / "libember_nccl.so").write_bytes(b"")
    stubbed = session.preload_env("save", env, comm_stub=True)["LD_PRELOAD"].split(":")
    assert stubbed == [str(lib), str(tmp_path / "libember_nccl.so"), "/x/libother.so"]
    plain = session.preload_env("load", {"LD_PRELOAD": ":".join(stubbed)})["LD_PRELOAD"].split(":")
    assert plain == [str(lib), "/x/libother.so"]  # a LOAD child never inherits the stub


def test_a_save_job_of_a_parallel_identity_runs_under_the_stub() -> None:
    from ember.engines.decode.workloads import identity_parallel, parallel_shape
    from ember.identity import ArchiveIdentity, Parallelism

    def ident(collectives: bool = False, **par: int) -> ArchiveIdentity:
        return ArchiveIdentity(model="m", engine="ember-decode", engine_version="1", capture_sizes=(1,),
                               parallelism=Parallelism(**par),
                               workload={"collectives": "true"} if collectives else {})

    cases = (({}, False), ({"tensor": 2}, True), ({"data": 2, "expert": 2}, True), ({"data": 4}, True),
             ({"collectives": True}, True))  # the splice check: collectives in a world of one
    for par, stub in cases:
        assert bool(identity_parallel(ident(**par)).active) is stub, par  # type: ignore[arg-type]
    assert parallel_shape(1, 2, 1).active and not parallel_shape(1, 1, 1).active
    assert parallel_shape(1, 4, 1).degrees() == {"tensor": 1, "expert": 4, "data": 4, "collectives": False}


def test_the_proof_zeroes_what_each_graphs_placeholders_stand_for_writing() -> None:
    """Under the stub a collective's receive buffer keeps what the memory held; SAVE's proof zeroes
    it before each replay (an all-gather's holds one count per rank), per graph key."""
    gs, t = _table()
    recv = 0x6000_0000_0000
    assert t.received() == {0: [(recv, 4096 * 2)], 1: [(recv, 128 * 2 * 2), (recv, 4096 * 2)]}
    assert comm.stub_writes(gs, t) == {(1,): [(recv, 8192)], (2,): [(recv, 512), (recv, 8192)]}
    assert comm.stub_writes(gs, None) == {}
    assert comm.Call.from_record(_call(1, "send", 16, 1)).received(2) is None  # a send writes nothing here
    assert comm.Call.from_record({**_call(1), "dtype": 42}).received(2) is None  # unknown size: left alone
