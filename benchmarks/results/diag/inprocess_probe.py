"""In-process probe (no native library): capture → walk → encode/decode → prove → LOAD-like rebuild.

Prints one JSON object: capture, walk, proof and template-build timings, exec-update switch
times, TPOT native vs restored and token identity. Used before the cross-process path exists;
`ember bench graphs` is the real benchmark.

    python benchmarks/results/diag/inprocess_probe.py llama3-8b [--layers N] [--sizes all|small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from ember.archive import graph_table as fmt
from ember.engines.decode.model import DEFAULT_SIZES, DecodeWorkload
from ember.runtime.graphs.kernels import LiveResolver
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.prove import prove
from ember.runtime.proof.replay import decode_tokens, tpot_ms


def load_like(blob: bytes, resolver: LiveResolver, out: dict[str, Any]) -> GraphLibrary:
    """LOAD-like: a fresh library from the table blob, templates first (timed), then every
    other graph, then template switches over all keys; the timings go into `out`."""
    t = time.perf_counter()
    table = fmt.decode(blob)
    for g in table.groups:
        table.chunk(g.template)
    parse_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    lib = GraphLibrary(table, [resolver.function(r) for r in table.kernels])
    lib.build_templates()
    torch.cuda.synchronize()
    out["load_like_ms"] = parse_ms + (time.perf_counter() - t) * 1e3
    out["load_like_parts"] = {"parse_ms": parse_ms, **lib.timings.__dict__}
    t = time.perf_counter()
    lib.prebuild_all()
    out["prebuild_rest_ms"] = (time.perf_counter() - t) * 1e3
    lib.switch_ms.clear()
    for _ in range(3):
        for i in range(len(lib.keys)):
            lib.exec_for(i)
    sw = sorted(lib.switch_ms)
    if sw:
        out["switch_ms"] = {"p50": statistics.median(sw), "p99": sw[int(0.99 * (len(sw) - 1))], "n": len(sw)}
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--sizes", default="all")
    a = ap.parse_args()
    sizes = DEFAULT_SIZES if a.sizes == "all" else tuple(int(s) for s in a.sizes.split(","))
    out: dict[str, Any] = {"workload": a.workload, "device": torch.cuda.get_device_name()}
    t = time.perf_counter()
    w = DecodeWorkload.from_name(a.workload, layers=a.layers or None, sizes=sizes)
    w.build()
    out["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    w.capture()
    out["native_capture_s"] = time.perf_counter() - t
    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    t = time.perf_counter()
    graphs = [walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in w.sizes]
    out["walk_s"] = time.perf_counter() - t
    out["walk_stats"] = walker.stats
    out["kernels"] = len(walker.kernels)
    gs = walker.graph_set(graphs)
    rep, blob, lib = prove(w, gs, lambda refs: [resolver.function(r) for r in refs])
    out["proof"] = {k: v for k, v in rep.__dict__.items() if k != "mismatches"}
    out["proof_ok"] = rep.ok
    out["mismatches"] = rep.mismatches[:5]
    out["table_bytes"] = len(blob)
    out["proof_switch_ms_p50"] = statistics.median(lib.switch_ms) if lib.switch_ms else None
    lib.close()
    lib = load_like(blob, resolver, out)
    lib.own.hot_after = 0
    toks = {}
    for b in [s for s in (1, 8, 64) if s in w.sizes]:
        n, _ = decode_tokens(w, lambda k: w.graphs[k].replay(), b)
        r, _ = decode_tokens(w, lambda k: lib.launch(lib.key_index(k)), b)
        toks[b] = n == r
    out["tokens_identical"] = toks
    tp = {}
    for b in [s for s in (1, 64) if s in w.sizes]:
        lib.own.instantiate(lib.key_index((b,)))
        tp[b] = {
            "native": tpot_ms(w, lambda k: w.graphs[k].replay(), b),
            "restored": tpot_ms(w, lambda k: lib.launch(lib.key_index(k)), b),
        }
    out["tpot_ms"] = tp
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
