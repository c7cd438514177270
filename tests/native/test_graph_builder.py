"""libember's graph builder (ember_build_graphs) against the stand-in driver: graphs prepared
from an archive's graph table by prepare_table.prepare_from_table are built on worker threads with
every node (in order, with its function, dimensions and attributes) and every edge with its edge
data; edge data a driver drops and nodes it refuses come back as named failures, leaking nothing."""

from __future__ import annotations

import json

BUILD = """
import numpy as np
from ember.archive import graph_table
from ember.archive.graphs import NodeType
from ember_testing.synthetic import synthetic_graphset
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.walk import ATTR_SIZES
cuda.standin_graph_dump.restype = ctypes.c_size_t
cuda.standin_graph_dump.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

class Events(dict):
    def __missing__(self, i):
        return 0xE0000 + i

gs = synthetic_graphset(graphs=6, nodes=300, groups=3, child_graphs=False)
table = graph_table.decode(graph_table.encode(gs))
functions = [0x7000 + k for k in range(len(table.kernels))]
attrs = rebuild.AttrSets(table)

def dump(g):
    buf = ctypes.create_string_buffer(1 << 20)
    n = cuda.standin_graph_dump(int(g), buf, len(buf))
    lines = buf.raw[:n].decode().splitlines()
    nodes = [l.split()[1:] for l in lines if l[0] == "N"]
    edges = sorted(tuple(map(int, l.split()[1:])) for l in lines if l[0] == "E")
    return nodes, edges

def expected(graph):
    nodes = []
    for n in graph.nodes:
        p = n.params
        if n.type == NodeType.KERNEL:
            ids = sorted(a for a in p.attrs if a in ATTR_SIZES)
            nodes.append([str(int(n.type)), str(functions[p.kernel]), *map(str, p.grid), str(p.block[0]),
                          str(p.shared_mem), *map(str, ids)])
        else:
            nodes.append([str(int(n.type))])
    edges = sorted((e.src, e.dst, e.from_port, e.to_port, e.type) for e in graph.edges)
    return nodes, edges

def compare(g, graph):
    got_nodes, got_edges = dump(g)
    want_nodes, want_edges = expected(graph)
    assert len(got_nodes) == len(want_nodes)
    for i, (a, b) in enumerate(zip(got_nodes, want_nodes)):
        if b[0] == "0":
            assert a[:7] + sorted(a[7:], key=int) == b, (i, a, b)
        else:
            assert a[0] == b[0], (i, a, b)
    assert got_edges == want_edges
    return len(got_edges), sum(1 for e in got_edges if e[4])
"""


def test_graphs_from_a_table_are_built_node_for_node_on_threads(run_py) -> None:
    out = run_py(BUILD + """
preps = [rebuild.prepare_from_table(table, i, functions, None, attrs) for i in range(len(table.keys))]
built, t = rebuild.build_native(preps, 1, Events(), instantiate=True, threads=3, interposer=ip)
assert all(b is not None and b[1] is not None for b in built), built
stats = [compare(b[0], gs.graphs[i]) for i, b in enumerate(built)]
print(json.dumps({"stats": stats, "threads": t["threads"], "execs": cuda.standin_execs_alive()}))
""")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["threads"] == 3 and r["execs"] == 6
    assert all(edges > 250 and prog >= 5 for edges, prog in r["stats"])  # programmatic edges kept


def test_edge_data_survives_a_driver_that_drops_it_in_mixed_calls(run_py) -> None:
    out = run_py(BUILD + """
preps = [rebuild.prepare_from_table(table, i, functions, None, attrs) for i in range(2)]
built, _ = rebuild.build_native(preps, 1, Events(), instantiate=False, threads=2, interposer=ip)
print(json.dumps([compare(b[0], gs.graphs[i])[1] for i, b in enumerate(built)]))
""", env={"STANDIN_MIXED_EDGES_DROP_DATA": "1"})
    assert all(n >= 5 for n in json.loads(out.stdout.strip().splitlines()[-1]))


def test_dropped_edge_data_leaves_the_graph_to_the_python_path(run_py) -> None:
    out = run_py(BUILD + """
preps = [rebuild.prepare_from_table(table, i, functions, None, attrs) for i in range(3)]
built, _ = rebuild.build_native(preps, 1, Events(), instantiate=True, threads=2, interposer=ip)
print(json.dumps({"built": [b is not None for b in built], "execs": cuda.standin_execs_alive()}))
""", env={"STANDIN_EDGES_DROP_DATA": "1"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"built": [False, False, False], "execs": 0}


def test_a_refused_node_is_named_and_nothing_is_kept(run_py) -> None:
    out = run_py(BUILD + """
bad = list(functions)
bad[table.graph(2).nodes[40].params.kernel] = 0   # a NULL function: the driver refuses the node
preps = [rebuild.prepare_from_table(table, i, bad if i == 2 else functions, None, attrs) for i in range(4)]
try:
    rebuild.build_native(preps, 1, Events(), instantiate=True, threads=4, interposer=ip)
except rebuild.RebuildError as exc:
    print(json.dumps({"error": str(exc), "execs": cuda.standin_execs_alive()}))
""")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["execs"] == 0
    assert r["error"].startswith("graph (3,): node ") and "kernel node failed" in r["error"]


def test_graph_objects_prepare_the_same_arrays(run_py) -> None:
    out = run_py(BUILD + """
g = gs.graphs[4]
prep = rebuild.prepare(g, functions, None)
built, _ = rebuild.build_native([prep], 1, Events(), instantiate=False, threads=1, interposer=ip)
print(json.dumps(compare(built[0][0], g)))
""")
    edges, prog = json.loads(out.stdout.strip().splitlines()[-1])
    assert edges > 250 and prog >= 5


def test_collective_placeholders_are_built_as_child_graphs(run_py) -> None:
    """A multi-GPU archive's placeholder memsets (ember.runtime.comm) become child-graph nodes of
    the rank's captured collective, with the placeholder's edges; other memsets stay memsets."""
    out = run_py(BUILD + """
from ember.archive.graphs import Edge, Graph, GraphSet, MemsetParams, Node
from ember.runtime.graphs.prepared import mark_splices
S = 0x7F0000001000
nodes = [Node(NodeType.EMPTY), Node(NodeType.MEMSET, MemsetParams(S, 0, 1, 4, 1, 1)),
         Node(NodeType.MEMSET, MemsetParams(0x600000000000, 0, 0, 4, 8, 1)),
         Node(NodeType.MEMSET, MemsetParams(S, 0, 2, 4, 1, 1)), Node(NodeType.EMPTY)]
graph = Graph((8,), nodes, [Edge(0, 1), Edge(1, 2), Edge(2, 3), Edge(3, 4), Edge(0, 4)])
t = graph_table.decode(graph_table.encode(GraphSet([graph], [], [])))
prep = rebuild.prepare_from_table(t, 0, [], None, rebuild.AttrSets(t))
mark_splices(prep, [(1, 0), (3, 1)])
children = {0: 0xC0FFEE0, 1: 0xBEEF0}
built, _ = rebuild.build_native([prep], 1, Events(), instantiate=False, threads=1, interposer=ip,
                                splices=children.__getitem__)
nodes_out, edges_out = dump(built[0][0])
print(json.dumps({"nodes": [n[:2] for n in nodes_out], "edges": edges_out}))
""")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["nodes"] == [["5", "0"], ["4", str(0xC0FFEE0)], ["2", str(0x600000000000)], ["4", str(0xBEEF0)],
                          ["5", "0"]]
    assert r["edges"] == [[0, 1, 0, 0, 0], [0, 4, 0, 0, 0], [1, 2, 0, 0, 0], [2, 3, 0, 0, 0], [3, 4, 0, 0, 0]]
