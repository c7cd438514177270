"""`ember bench parse`: graph-table decode speed on a synthetic archive (no GPU).

`parse_ms_512` is the figure `ember bench graphs` reports next to its GPU timings: how long LOAD
takes to open a 512-graph table shaped like an 8B decode set before it can build templates.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from ember.archive.graph_table import GraphTable, encode
from ember_testing.synthetic import synthetic_graphset


def parse_ms_512(graphs: int = 512, nodes: int = 1800, groups: int = 7, repeat: int = 5,
                 seed: int = 0) -> dict[str, Any]:
    """Decode timings on a synthetic archive shaped like an 8B decode set (for `ember bench`):
    kernel nodes (packed and `extra` arguments, cluster attributes), memsets, memcpys, events,
    programmatic edges, batch-dependent grids and arguments; no child graphs.

    Returns milliseconds (best of `repeat`) for: `open_ms` (header + index + every group's
    template chunk: what LOAD needs before building templates; this is `parse_ms_512`),
    `all_chunks_ms` (every graph's params decompressed and checked, one thread), `materialize_graph_ms`
    (one graph turned into Python `Graph` objects), and sizes.
    """
    gs = synthetic_graphset(graphs=graphs, nodes=nodes, groups=groups, seed=seed, child_graphs=False)
    t0 = time.perf_counter()
    blob = encode(gs)
    encode_s = time.perf_counter() - t0

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    def open_templates() -> GraphTable:
        table = GraphTable(blob)
        for g in table.groups:
            table.chunk(g.template)
        _ = table.keys
        return table

    def all_chunks() -> None:
        GraphTable(blob).validate(threads=1)

    table = open_templates()
    return {
        "graphs": graphs,
        "nodes_per_graph": nodes,
        "groups": len(table.groups),
        "parse_ms_512": round(best(open_templates), 3),
        "all_chunks_ms": round(best(all_chunks), 3),
        "materialize_graph_ms": round(best(lambda: table.graph(graphs // 2)), 3),
        "table_bytes": len(blob),
        "encode_s": round(encode_s, 2),
    }


def bench_parse(
    graphs: Annotated[int, typer.Option(help="Graphs in the synthetic archive.")] = 512,
    nodes: Annotated[int, typer.Option(help="Nodes per graph.")] = 1800,
    groups: Annotated[int, typer.Option(help="Topology groups.")] = 7,
    repeat: Annotated[int, typer.Option(help="Timing repetitions (best is reported).")] = 5,
) -> None:
    """Graph-table decode speed on a synthetic archive (parse_ms_512 and full decode), as JSON."""
    Console().print_json(json.dumps(parse_ms_512(graphs=graphs, nodes=nodes, groups=groups, repeat=repeat)))
