"""How many templates would an archive need under other union policies? No GPU.

Reads a published archive's graph table and plans its unions again (`ember.archive.union`) under
each policy below, next to the unions the archive holds. A template is a union or a topology
group with a member outside every union. For each policy it lists the unions (members' keys,
length, optional slots, programmatic edges kept) and why the graphs left out are not chains.

    python -m ember_bench.union_whatif STORE_URI [IDENTITY] [--out FILE.json]

Policies: `default` (what SAVE writes now), `programmatic` (EMBER_UNION_PROGRAMMATIC=1),
`programmatic, growth 2.0`, and `programmatic, memsets`: EMBER_UNION_MEMSETS=1 too, a member
may lack a 1-D memset, where it runs a placeholder writing scratch.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from ember.archive import bundle
from ember.archive.graphs import NodeType
from ember.archive.topology import group_graphs, group_index
from ember.archive.union import MAX_GROWTH, OPTIONAL_NODES, not_a_chain, union_groups
from ember.store import open_store

POLICIES: dict[str, dict[str, Any]] = {
    "default": {"programmatic": False},
    "programmatic": {"programmatic": True},
    "programmatic, growth 2.0": {"programmatic": True, "max_growth": 2.0},
    "programmatic, memsets": {"programmatic": True, "optional": OPTIONAL_NODES | {NodeType.MEMSET}},
}


def plan(graphs: list[Any], fattrs: Any, **policy: Any) -> dict[str, Any]:
    """The templates one policy needs, and its unions."""
    groups = group_graphs(graphs, fattrs)
    of = group_index(groups, len(graphs))
    unions = union_groups(graphs, fattrs, max_growth=policy.get("max_growth", MAX_GROWTH),
                          programmatic=policy["programmatic"],
                          optional=policy.get("optional", OPTIONAL_NODES))
    united = {m for u in unions for m in u.members}
    left = {of[g] for g in range(len(graphs)) if g not in united}
    why = Counter(_why_out(graphs[g], policy["programmatic"]) for g in range(len(graphs)) if g not in united)
    return {
        "templates": len(unions) + len(left),
        "topology_groups": len(groups),
        "unions": [_union(u, graphs) for u in unions],
        "groups_left": len(left),
        "left_out_because": dict(why),
    }


def _why_out(graph: Any, programmatic: bool) -> str:
    """Why a graph is in no union, in a word or three."""
    if not not_a_chain(graph, programmatic):
        return "did not merge"  # another memset or memcpy, or past the growth cap
    if not programmatic and not not_a_chain(graph, True):
        return "programmatic edges"
    return "not a chain"


def _union(u: Any, graphs: list[Any]) -> dict[str, Any]:
    longest = max(len(graphs[m].nodes) for m in u.members)
    return {
        "members": [list(graphs[m].key) for m in u.members],
        "nodes": len(u.graph.nodes),
        "over_longest": round(len(u.graph.nodes) / longest, 3),
        "optional_slots": len(u.optional()),
        "placeholders": sum(1 for s in u.optional() if u.graph.nodes[s].type == NodeType.MEMSET),
        "programmatic_edges": sum(1 for e in u.graph.edges if e.from_port or e.to_port or e.type),
    }


def main(
    store_uri: str,
    identity: Annotated[str | None, typer.Argument()] = None,
    out: Annotated[Path | None, typer.Option(help="Write the full report here (JSON).")] = None,
) -> None:
    archive = bundle.open_archive(open_store(store_uri), identity)
    table = archive.graph_table
    gs = table.to_graphset()
    report: dict[str, Any] = {"graphs": len(gs.graphs), "saved_unions": len(table.unions)}
    for name, policy in POLICIES.items():
        report[name] = plan(list(gs.graphs), gs.function_attrs, **policy)
        r = report[name]
        sizes = ", ".join(f"{len(u['members'])}×{u['nodes']}" for u in r["unions"])
        print(f"{name:32} {r['templates']:3} templates ({len(r['unions'])} unions: {sizes or '-'}; "
              f"{r['groups_left']} of {r['topology_groups']} topology groups left) "
              f"left out: {r['left_out_because'] or '-'}")
    if out is not None:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    typer.run(main)
