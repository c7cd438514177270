"""CPU: a collective table over several communicators (vLLM's parallel groups). SAVE names each
call's group from the engine's map of the stub's communicator ids, in a rank-independent way;
LOAD maps each group to this rank's real communicator of that group, and refuses a missing group,
another size, another world; an old table (no groups) still means the world's one communicator."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("cuda.bindings")

from ember.archive.collectives import WORLD, Call, Collectives, CommGroup
from ember.archive.graphs import Edge, Graph, GraphSet, MemsetParams, Node, NodeType
from ember.runtime import comm, restore
from ember.runtime.adapter import Refused

SCRATCH = 0x7F00_0000_1000
TP, DP = CommGroup("tp:0", 2), CommGroup("dp:0", 2)


def _call(seq: int, op: str, comm_id: int, nranks: int = 2, peer: int = -1) -> dict[str, Any]:
    return {"seq": seq, "op": op, "send": 0x6000_0000_0000, "recv": 0x6000_0000_1000, "count": 64, "dtype": 9,
            "redop": 0 if op == "all_reduce" else -1, "root": peer, "comm": comm_id, "nranks": nranks,
            "rank": 0, "stream": 1}


def _graphs(*values: list[int]) -> GraphSet:
    out = []
    for key, vals in enumerate(values):
        nodes = [Node(NodeType.EMPTY)]
        nodes += [Node(NodeType.MEMSET, MemsetParams(SCRATCH, 0, v, 4, 1, 1)) for v in vals]
        out.append(Graph((key,), nodes, [Edge(i, i + 1) for i in range(len(nodes) - 1)]))
    return GraphSet(graphs=out, kernels=[], function_attrs=[])


def _table() -> Collectives:
    # stub ids 3 (tp) and 5 (dp) are process-local: the table keeps their groups, not the ids
    by_seq = {1: [_call(1, "all_reduce", 3)], 2: [_call(2, "all_reduce", 5)],
              3: [_call(3, "broadcast", 5, peer=0), _call(3, "broadcast", 5, peer=1)]}
    t = comm.placeholders(_graphs([1, 2], [1, 3]), SCRATCH, by_seq, 4, "2.28.9", {3: TP, 5: DP})
    assert t is not None
    return t


def test_each_call_names_its_group_not_the_stubs_id() -> None:
    t = _table()
    assert t.comms == [TP, DP]
    assert [t.comm_of(i) for i in range(len(t.table))] == [0, 1, 1]
    assert Collectives.from_facts(json.loads(json.dumps(t.to_facts()))) == t
    assert t.summary()[0].endswith("on tp:0 (2 ranks)")


def test_the_same_call_on_two_groups_is_two_collectives() -> None:
    by_seq = {1: [_call(1, "all_reduce", 3)], 2: [_call(2, "all_reduce", 5)]}
    t = comm.placeholders(_graphs([1, 2]), SCRATCH, by_seq, 4, "", {3: TP, 5: DP})
    assert t is not None and len(t.table) == 2


@pytest.mark.parametrize(
    ("by_seq", "message"),
    [
        ({1: [_call(1, "all_reduce", 9)]}, "no parallel group the engine named"),
        ({1: [_call(1, "all_reduce", 3, nranks=4)]}, "in group tp:0 of 2"),
        ({1: [_call(1, "all_reduce", 3), _call(1, "all_reduce", 5)]}, "on 2 communicators"),
        ({1: [_call(1, "send", 3, peer=1)]}, "rank-specific"),
    ],
)
def test_calls_no_group_explains_are_refused_at_save(by_seq: dict, message: str) -> None:
    with pytest.raises(comm.PlaceholderError, match=message):
        comm.placeholders(_graphs([1]), SCRATCH, by_seq, 4, "", {3: TP, 5: DP})


def test_an_old_table_is_the_worlds_one_communicator() -> None:
    old = {"world": 2, "nccl_version": "", "nodes": {"0": [[1, 0]]},
           "table": [[{"op": "all_reduce", "send": 1, "recv": 1, "count": 4, "dtype": 9, "redop": 0,
                       "root": -1}]]}
    t = Collectives.from_facts(old)
    assert t.comms == [CommGroup(WORLD, 2)] and t.comm_of(0) == 0
    assert t.table[0][0] == Call("all_reduce", 1, 1, 4, 9, 0, -1, 0)
    s = comm.Splicer(t, 0xC0FFEE, 2, 1)  # the decode adapter's (ncclComm_t, world, rank)
    assert s.comms == [0xC0FFEE] and s.rank == 1


def test_a_decode_save_writes_the_world_group() -> None:
    by_seq = {1: [_call(1, "all_reduce", 0)]}
    t = comm.placeholders(_graphs([1]), SCRATCH, by_seq, 2, "")
    assert t is not None and t.comms == [CommGroup(WORLD, 2)]


def _here(**groups: tuple[int, int, int]) -> comm.Communicators:
    return comm.Communicators(world=4, rank=3, groups=dict(groups))


def test_each_group_maps_to_this_ranks_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm, "nccl_version", lambda: "2.28.9")
    s = comm.Splicer(_table(), _here(**{"dp:0": (0xD0, 2, 1), "tp:0": (0x70, 2, 1), "ep:0": (0xE0, 4, 3)}))
    assert s.comms == [0x70, 0xD0]


def test_several_communicators_are_captured_one_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember import native

    seen: list[tuple[int, int]] = []

    class Fake:
        def capture_collectives(self, c: int, groups: list) -> tuple[list[int], list[int]]:
            seen.append((c, len(groups)))
            return [c + i for i in range(len(groups))], [7] * len(groups)

    monkeypatch.setattr(comm, "nccl_version", lambda: "2.28.9")
    monkeypatch.setattr(native.Interposer, "attach", staticmethod(lambda: Fake()))
    s = comm.Splicer(_table(), _here(**{"tp:0": (0x700, 2, 1), "dp:0": (0xD00, 2, 1)}))
    s.capture()
    assert seen == [(0x700, 1), (0xD00, 2)]
    assert [s.graph(i) for i in range(3)] == [0x700, 0xD00, 0xD01]
    s._graphs = []  # nothing real to destroy


@pytest.mark.parametrize(
    ("groups", "world", "message"),
    [
        ({"tp:0": (0x70, 2, 1)}, 4, "no such communicator"),
        ({"tp:0": (0x70, 4, 1), "dp:0": (0xD0, 2, 1)}, 4, "tp:0 has 4 ranks here, 2 in the archive"),
        ({"tp:0": (0, 2, 1), "dp:0": (0xD0, 2, 1)}, 4, "no NCCL communicator of group tp:0"),
        ({"tp:0": (0x70, 2, 1), "dp:0": (0xD0, 2, 1)}, 8, "world of 4, this rank is in 8"),
    ],
)
def test_a_group_that_does_not_fit_is_refused(monkeypatch: pytest.MonkeyPatch, groups: dict, world: int,
                                              message: str) -> None:
    monkeypatch.setattr(comm, "nccl_version", lambda: "2.28.9")
    with pytest.raises(Refused, match=message):
        comm.Splicer(_table(), comm.Communicators(world, 0, groups))


def test_another_nccl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm, "nccl_version", lambda: "2.27.3")
    with pytest.raises(Refused, match=r"NCCL 2\.28\.9 at SAVE, 2\.27\.3 here"):
        comm.Splicer(_table(), _here(**{"tp:0": (0x70, 2, 1), "dp:0": (0xD0, 2, 1)}))


def test_restore_refuses_without_communicators_or_with_a_damaged_table() -> None:
    facts = {"collectives": _table().to_facts()}
    with pytest.raises(Refused, match="no communicator here"):
        restore._splicer(facts, None)
    with pytest.raises(Refused, match="not readable"):
        restore._splicer({"collectives": {"world": 2}}, comm.Communicators(2, 0))


def test_vllms_groups_are_named_by_the_stubs_ids() -> None:
    from types import SimpleNamespace

    from ember.engines.vllm.parallel import stub_groups

    ids = {0x1000: 4, 0x2000: 7}
    stub = SimpleNamespace(ember_nccl_comm_id=lambda ptr: ids.get(ptr.value, -1))
    groups = [("tp:0", 0x1000, 2, 1), ("dp:0", 0x2000, 2, 0), ("ep:0", 0, 4, 1), ("pp:0", 0x3000, 2, 0)]
    assert stub_groups(stub, groups) == {4: TP, 7: DP}  # null and unknown communicators left out
