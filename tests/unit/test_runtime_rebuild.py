"""CPU: argument repacking for LOAD (kernelParams pointer arrays, `extra` option lists), the
table fast path against the object path, and edge data carried through preparation.

No GPU: prepare() makes no driver calls; the packed structs are read back with ctypes.
"""

from __future__ import annotations

import ctypes

import pytest

pytest.importorskip("cuda.bindings")

from ember.archive import graph_table
from ember.archive.graphs import Edge, Graph, GraphSet, KernelParams, KernelRef, Node, NodeType
from ember.runtime.graphs import build_graph, rebuild
from ember.runtime.graphs.prepared import OP_KERNEL
from ember.runtime.graphs.walk import KERNEL_PARAMS
from ember_testing.synthetic import synthetic_graphset


def _kernel_struct(op: tuple) -> tuple:
    return KERNEL_PARAMS.unpack(ctypes.string_at(op[1], KERNEL_PARAMS.size))


def _graph(params: list[KernelParams], edges: list[Edge] | None = None) -> Graph:
    return Graph(key=(7,), nodes=[Node(NodeType.KERNEL, p) for p in params], edges=edges or [])


def test_kernel_params_point_at_each_argument() -> None:
    args = bytes(range(24))
    p = KernelParams(
        kernel=1,
        grid=(3, 2, 1),
        block=(128, 1, 1),
        shared_mem=512,
        args=args,
        arg_offsets=(0, 8, 16),
        arg_sizes=(8, 4, 8),
    )
    prep = rebuild.prepare(_graph([p]), [0x1000, 0x2000], None)
    func, gx, gy, gz, bx, by, bz, smem, kp, extra, kern, ctx = _kernel_struct(prep.ops[0])
    assert (func, gx, gy, gz, bx, by, bz, smem) == (0x2000, 3, 2, 1, 128, 1, 1, 512)
    assert extra == 0 and kern == 0 and ctx == 0
    ptrs = (ctypes.c_uint64 * 3).from_address(kp)
    assert [ctypes.string_at(ptrs[i], s) for i, s in enumerate((8, 4, 8))] == [
        args[0:8],
        args[8:12],
        args[16:24],
    ]


def test_extra_blob_is_passed_whole_with_its_size() -> None:
    blob = bytes(range(256)) * 7  # 1792 bytes, like cuBLAS' opaque argument
    p = KernelParams(kernel=0, grid=(1, 1, 1), block=(32, 1, 1), shared_mem=0, extra=blob)
    prep = rebuild.prepare(_graph([p]), [0x1000], None)
    *_, kp, extra, _kern, _ctx = _kernel_struct(prep.ops[0])
    assert kp == 0 and extra != 0
    words = (ctypes.c_uint64 * 5).from_address(extra)
    assert words[0] == 1 and words[2] == 2 and words[4] == 0
    assert ctypes.c_uint64.from_address(words[3]).value == len(blob)
    assert ctypes.string_at(words[1], len(blob)) == blob


def test_short_argument_buffer_is_refused() -> None:
    p = KernelParams(
        kernel=0,
        grid=(1, 1, 1),
        block=(1, 1, 1),
        shared_mem=0,
        args=b"\0" * 4,
        arg_offsets=(0,),
        arg_sizes=(8,),
    )
    with pytest.raises(ValueError, match="needs 8"):
        rebuild.pack_arguments(p)


def test_attributes_and_programmatic_edges_survive_preparation() -> None:
    attr = bytes([2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]) + bytes(52)  # cluster dimension 2x1x1
    a = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0, attrs={4: attr})
    b = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    edges = [Edge(0, 1, from_port=1, to_port=0, type=1)]
    prep = rebuild.prepare(_graph([a, b], edges), [0x1000], None)
    ((attr_id, addr),) = prep.ops[0][2]  # the value's address, as the C entry point takes it
    assert attr_id == 4 and ctypes.string_at(addr, 64) == attr
    assert prep.ops[1][2] == []
    assert prep.edge_src == [0] and prep.edge_dst == [1]
    assert prep.edge_data == bytes([1, 0, 1, 0, 0, 0, 0, 0])  # one CUgraphEdgeData


def test_kernel_index_out_of_range_names_graph_and_node() -> None:
    p = KernelParams(kernel=5, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    with pytest.raises(rebuild.RebuildError, match=r"graph \(7,\): node 0: kernel index 5"):
        rebuild.prepare(_graph([p]), [0x1000], None)


def _summary(prep: rebuild.PreparedGraph) -> list:
    out = []
    for op in prep.ops:
        if op[0] != OP_KERNEL:
            out.append(op[0])
            continue
        v = _kernel_struct(op)
        if v[8]:
            payload = ctypes.string_at(ctypes.c_uint64.from_address(v[8]).value, 4)
        elif v[9]:
            w = (ctypes.c_uint64 * 6).from_address(v[9])
            payload = (w[0], w[2], w[4], ctypes.string_at(w[1], w[5]))
        else:
            payload = None
        out.append((v[:8], payload, [(a, ctypes.string_at(x, 64)) for a, x in op[2]]))
    raw = prep.edge_data or b""
    edges = [tuple(raw[j : j + 3]) for j in range(0, len(raw), 8)]
    return [out, prep.edge_src, prep.edge_dst, edges]


def test_table_fast_path_matches_object_path() -> None:
    gs = synthetic_graphset(graphs=5, nodes=240, groups=2)
    table = graph_table.decode(graph_table.encode(gs))
    functions = [0x7000 + 16 * i for i in range(len(table.kernels))]
    sets = rebuild.AttrSets(table)
    for i in range(table.count):
        slow = rebuild.prepare(table.graph(i), functions, None)
        fast = rebuild.prepare_from_table(table, i, functions, None, sets)
        assert _summary(fast) == _summary(slow), f"graph {i}"


def test_graphset_round_trip_keeps_what_rebuild_needs() -> None:
    p = KernelParams(
        kernel=0,
        grid=(4, 1, 1),
        block=(64, 1, 1),
        shared_mem=16,
        args=b"\1" * 16,
        arg_offsets=(0, 8),
        arg_sizes=(8, 8),
        attrs={8: bytes([1]) + bytes(63)},
    )
    gs = GraphSet([_graph([p, p], [Edge(0, 1, 1, 0, 1)])], [KernelRef("ab" * 8, "k")], [])
    table = graph_table.decode(graph_table.encode(gs))
    assert _summary(rebuild.prepare(table.graph(0), [0x10], None)) == _summary(
        rebuild.prepare(gs.graphs[0], [0x10], None)
    )


class _FakeDriverEdges:
    """Edges as driver 580 kept them (H200, 2026-11-22): a call adding several edges keeps none of
    their edge data; a call adding one edge keeps it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.frm: list[int] = []
        self.to: list[int] = []
        self.data = b""

    def add(self, g: object, frm: list, to: list, data: bytes | None) -> None:
        self.calls.append((list(frm), list(to), data))
        keep = data if data is not None and len(frm) == 1 else bytes(8 * len(frm))
        self.frm += frm
        self.to += to
        self.data += keep

    def read(self, g: object) -> tuple:
        return self.frm, self.to, self.data


def _fake(monkeypatch: pytest.MonkeyPatch) -> _FakeDriverEdges:
    fake = _FakeDriverEdges()
    monkeypatch.setattr(build_graph.driver, "add_dependencies", fake.add)
    monkeypatch.setattr(build_graph.driver, "graph_edges", fake.read)
    return fake


PROG = bytes([1, 0, 1, 0, 0, 0, 0, 0])


def test_nondefault_edges_go_one_per_call_before_the_default_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake(monkeypatch)
    k = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    edges = [Edge(0, 1), Edge(1, 2, from_port=1, type=1), Edge(0, 2), Edge(2, 3, from_port=1, type=1)]
    prep = rebuild.prepare(_graph([k, k, k, k], edges), [0x1000], None)
    assert prep.edge_data == bytes(8) + PROG + bytes(8) + PROG  # grouped by destination, stable
    build_graph.add_edges(object(), prep, [10, 11, 12, 13], "nondefault-single-first")
    assert fake.calls == [([11], [12], PROG), ([12], [13], PROG), ([10, 10], [11, 12], None)]
    fake2 = _fake(monkeypatch)
    prep_default = rebuild.prepare(_graph([k, k], [Edge(0, 1)]), [0x1000], None)
    build_graph.add_edges(object(), prep_default, [20, 21], "nondefault-single-first")
    assert fake2.calls == [([20], [21], None)]  # no edge data at all: one call, nothing to read back


def test_batched_edges_losing_their_data_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch)
    k = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    prep = rebuild.prepare(_graph([k, k, k], [Edge(0, 1), Edge(1, 2, from_port=1, type=1)]), [0x1000], None)
    with pytest.raises(rebuild.EdgeDataLost, match=r"\(batched\).*0 non-default\) read back, 2 \(1 non"):
        build_graph.add_edges(object(), prep, [1, 2, 3], "batched")
    fake = _fake(monkeypatch)
    build_graph.add_edges(object(), prep, [1, 2, 3], "all-single")
    assert [len(c[0]) for c in fake.calls] == [1, 1]


def test_build_falls_back_to_the_next_edge_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy whose edge data does not survive is abandoned for the process; the graph is
    built again with the next one."""
    fakes: list[_FakeDriverEdges] = []
    destroyed: list[object] = []
    handles = iter(range(100, 200))

    def create(flags: int) -> tuple:
        fakes.append(_fake(monkeypatch))
        return (build_graph.OK, f"graph{len(fakes)}")

    monkeypatch.setattr(build_graph.cu, "cuGraphCreate", create)
    monkeypatch.setattr(build_graph.cu, "cuGraphDestroy", destroyed.append)
    monkeypatch.setattr(
        build_graph.cu, "cuGraphAddEmptyNode", lambda g, deps, n: (build_graph.OK, next(handles))
    )
    monkeypatch.setattr(build_graph, "EDGE_STRATEGIES", ("batched", "nondefault-single-first"))
    monkeypatch.setattr(build_graph, "_edge_strategy", [0])
    g = Graph((3,), [Node(NodeType.EMPTY)] * 3, [Edge(0, 1), Edge(1, 2, from_port=1, type=1)])
    built = rebuild.build(rebuild.prepare(g, [], None), None, [])
    assert built == "graph2" and destroyed == ["graph1"]
    assert rebuild.edge_strategy() == "nondefault-single-first"
    assert fakes[-1].data.count(1) == 2  # the programmatic edge's from_port and type survived
    rebuild.build(rebuild.prepare(g, [], None), None, [])  # the next graph starts with what works
    assert destroyed == ["graph1"]
    monkeypatch.setattr(build_graph, "EDGE_STRATEGIES", ("batched",))
    monkeypatch.setattr(build_graph, "_edge_strategy", [0])
    with pytest.raises(rebuild.RebuildError, match="every edge strategy tried: batched"):
        rebuild.build(rebuild.prepare(g, [], None), None, [])


def test_edge_data_lost_by_the_driver_is_a_rebuild_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """What happened through cuda.bindings: edges added, programmatic data gone. Never silent."""
    held: dict[str, tuple] = {}
    monkeypatch.setattr(
        build_graph.driver,
        "add_dependencies",
        lambda g, frm, to, data: held.update(edges=(list(frm), list(to), bytes(8 * len(frm)))),
    )
    monkeypatch.setattr(build_graph.driver, "graph_edges", lambda g: held["edges"])
    k = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    prep = rebuild.prepare(_graph([k, k, k], [Edge(0, 1), Edge(1, 2, from_port=1, type=1)]), [0x1000], None)
    with pytest.raises(rebuild.RebuildError, match=r"edge data lost.*\(1 non-default\) added"):
        build_graph.add_edges(object(), prep, [1, 2, 3], "all-single")


def test_edge_data_problem_compares_multisets() -> None:
    k = KernelParams(kernel=0, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
    prep = rebuild.prepare(_graph([k, k, k], [Edge(0, 1), Edge(1, 2, from_port=1, type=1)]), [0x1000], None)
    prog = bytes([1, 0, 1, 0, 0, 0, 0, 0])
    # The driver may list edges in another order: same multiset, no problem.
    assert build_graph.edge_data_problem(prep, [7, 8, 9], ([8, 7], [9, 8], prog + bytes(8))) == ""
    assert "names a node" in build_graph.edge_data_problem(prep, [7, 8, 9], ([8, 5], [9, 8], prog + bytes(8)))
    assert build_graph.edge_data_problem(prep, [7, 8, 9], ([7, 8], [8, 9], bytes(16)))


def test_edge_data_is_packed_as_cugraphedgedata() -> None:
    from ember.runtime.graphs import driver

    raw = driver.pack_edge_data([(0, 0, 0), (1, 0, 1), (2, 0, 1)])
    assert raw == bytes(8) + bytes([1, 0, 1, 0, 0, 0, 0, 0]) + bytes([2, 0, 1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="does not fit"):
        driver.pack_edge_data([(256, 0, 1)])
    with pytest.raises(ValueError, match="differ in length"):
        driver.add_dependencies(object(), [1, 2], [3], None)
    with pytest.raises(ValueError, match="differ in length"):
        driver.add_dependencies(object(), [1], [3], bytes(16))
