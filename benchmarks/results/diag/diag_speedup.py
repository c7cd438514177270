"""Why do restored graphs run faster than captured ones? One process, no libember, bisected.

The cross-process bench found the restored decode step 4-13 % faster than native, and ruled out
libember's memory layout, torch's instantiate flags and replay() (a captured graph instantiated
by ember runs as fast as torch's). What is left is the graph itself or the process. Here, in ONE
process, with the SAME kernel functions (LiveResolver), per batch size:

- native: torch's replay() of the captured graph;
- captured+ember: the captured CUgraph instantiated by ember (cuGraphInstantiate, no flags);
- clone: cuGraphClone of the captured graph, instantiated (the driver's own copy);
- rebuilt: walked, encoded, decoded, rebuilt by LOAD's code (GraphLibrary, own exec);
- rebuilt-noattrs: the same, every kernel node attribute at its default but those a kernel needs
  to run at all (cooperative, cluster dimension and scheduling).

If `rebuilt` is as fast as `native` here, the cross-process speed-up comes from the LOAD process
(its kernel images loaded by libember), not from the graph. `cuGraphDebugDotPrint` (verbose) of
captured vs rebuilt B=1, addresses and handles normalised, is diffed: the differing lines are
counted by kind.

    python benchmarks/results/diag/diag_speedup.py llama3-8b --sizes 1,64 --out result.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from cuda.bindings import driver as cu

from ember.archive import graph_table as fmt
from ember.engines.decode.model import DecodeWorkload
from ember.runtime.graphs.driver import OK, check, torch_stream_handle
from ember.runtime.graphs.kernels import LiveResolver
from ember.runtime.graphs.rebuild import instantiate
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.replay import tpot_ms

_HEX = re.compile(r"0x[0-9a-fA-F]+")
KEEP_ATTRS = (2, 4, 5)  # cooperative, cluster dimension and scheduling: required to run at all
_ID = re.compile(r"\b(node|graph_\d+_node)_?\d+\b")


def _dot(graph: Any, path: Path) -> list[str]:
    check(cu.cuGraphDebugDotPrint(graph, str(path).encode(), 1), "cuGraphDebugDotPrint")  # VERBOSE
    return path.read_text(errors="replace").splitlines()


def _normalise(lines: list[str]) -> list[str]:
    return [_ID.sub("N", _HEX.sub("0x?", ln)) for ln in lines]


def dot_diff(captured: Any, rebuilt: Any, tmp: Path) -> dict[str, Any]:
    a = _normalise(_dot(captured, tmp / "captured.dot"))
    b = _normalise(_dot(rebuilt, tmp / "rebuilt.dot"))
    ca, cb = collections.Counter(a), collections.Counter(b)
    only_a, only_b = ca - cb, cb - ca
    kinds: collections.Counter[str] = collections.Counter()
    for ln in list(only_a.elements()) + list(only_b.elements()):
        kinds[re.sub(r"[^A-Za-z_]+", " ", ln).strip()[:60]] += 1
    return {
        "lines": [len(a), len(b)],
        "only_captured": sum(only_a.values()),
        "only_rebuilt": sum(only_b.values()),
        "kinds": kinds.most_common(15),
        "examples_captured": [ln[:300] for ln in list(only_a)[:12]],
        "examples_rebuilt": [ln[:300] for ln in list(only_b)[:12]],
    }


def _exec_tpot(w: Any, execs: dict[tuple[int, ...], Any], b: int) -> float:
    def launch(k: tuple[int, ...]) -> None:
        r = cu.cuGraphLaunch(execs[k], torch_stream_handle(None))
        if r[0] != OK:
            raise RuntimeError(f"cuGraphLaunch {r[0]}")

    return tpot_ms(w, launch, b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--sizes", default="1,64")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    sizes = tuple(int(s) for s in a.sizes.split(","))
    out: dict[str, Any] = {"workload": a.workload, "device": torch.cuda.get_device_name(), "sizes": sizes}
    w = DecodeWorkload.from_name(a.workload, layers=a.layers or None, sizes=sizes)
    w.build()
    w.capture()
    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    graphs = [walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in sizes]
    gs = walker.graph_set(graphs)
    out["attrs_per_kernel_node"] = collections.Counter(
        tuple(sorted(n.params.attrs)) for g in graphs for n in g.nodes if n.type.name == "KERNEL"
    ).most_common(5)
    lib = _library(gs, resolver)
    for g in gs.graphs:  # every kernel node attribute at its default, but the cluster ones
        for n in g.nodes:
            if n.type.name == "KERNEL":
                n.params.attrs = {a: v for a, v in n.params.attrs.items() if a in KEEP_ATTRS}
    bare = _library(gs, resolver)
    captured = {(b,): cu.CUgraph(int(w.graphs[(b,)].raw_cuda_graph())) for b in sizes}
    variants: dict[str, dict[tuple[int, ...], Any]] = {
        "captured+ember": {k: instantiate(g) for k, g in captured.items()},
        "clone": {k: instantiate(check(cu.cuGraphClone(g), "cuGraphClone")) for k, g in captured.items()},
        "rebuilt": {k: lib.own.instantiate(lib.key_index(k)) for k in captured},
        "rebuilt-noattrs": {k: bare.own.instantiate(bare.key_index(k)) for k in captured},
    }
    out["tpot_ms"] = _tpot_rounds(w, sizes, variants)
    with tempfile.TemporaryDirectory() as d:
        k = (sizes[0],)
        out["dot_diff"] = dot_diff(captured[k], lib.graph(lib.key_index(k)), Path(d))
    text = json.dumps(out, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


def _library(gs: Any, resolver: LiveResolver) -> GraphLibrary:
    """LOAD's path: encoded, decoded, rebuilt (same kernel functions as the capture)."""
    table = fmt.decode(fmt.encode(gs))
    lib = GraphLibrary(table, resolver.function_list(table.kernels), hot_after=0)
    lib.build_templates()
    return lib


def _tpot_rounds(w: Any, sizes: tuple[int, ...], variants: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Best of two interleaved rounds per variant and size (clocks and thermals drift)."""
    tp: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for _ in range(2):
        for b in sizes:
            t = tpot_ms(w, lambda k: w.graphs[k].replay(), b)
            tp["native"][b] = min(tp["native"].get(b, 1e9), t)
            for name, execs in variants.items():
                tp[name][b] = min(tp[name].get(b, 1e9), _exec_tpot(w, execs, b))
    return dict(tp)


if __name__ == "__main__":
    main()
