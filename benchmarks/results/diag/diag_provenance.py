"""Restored decode steps run ~9 % faster: the process, or where the kernel functions come from?

Per-kernel profiles (benchmarks/ember_bench/kernel_profile.py) show the kernels themselves run
equally long in the native and the LOAD process; the steps differ in the gaps between dependent
kernels. In a process without libember, LOAD's code rebuilding the captured graph with the
runtime's functions runs at native speed (diag_speedup.py). This times, in ONE LOAD process
(libember preloaded, the archive restored), per batch size:

- `restored`: the archive's graph on its own exec (functions from libember's loaded images);
- `captured`: the same step captured by torch here (the CUDA runtime's kernel functions);
- `rebuilt-runtime`: that capture walked and rebuilt by LOAD's code, with the runtime's functions.

If `captured` is as fast as `restored`, the LOAD process is the cause; if it is as slow as native,
the functions' provenance is. Each variant's step is also profiled (kernel time vs gaps), and each
variant's CUgraph instantiated here (`instantiate_ms`): whether LOAD's ~16 ms a graph is the
driver's cost for any graph of that size or something of the restored graph's.

    EMBER_MODE=load LD_PRELOAD=libember.so python benchmarks/results/diag/diag_provenance.py STORE IDENTITY
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from ember.engines.decode.adapter import load_workload
from ember.runtime.graphs.driver import OK, torch_stream_handle
from ember.runtime.graphs.kernels import LiveResolver
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.replay import tpot_ms
from ember_bench.kernel_profile import compare, profile_steps


def _rebuilt_with_runtime_functions(w: Any, sizes: tuple[int, ...]) -> Any:
    from ember.archive import graph_table as fmt
    from ember.runtime.graphs.templates import GraphLibrary

    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    gs = walker.graph_set([walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in sizes])
    table = fmt.decode(fmt.encode(gs))
    lib = GraphLibrary(table, resolver.function_list(table.kernels), hot_after=0)
    lib.build_templates()
    execs: dict[tuple[int, ...], Any] = {(b,): lib.own.instantiate(lib.key_index((b,))) for b in sizes}

    def launch(k: tuple[int, ...]) -> None:
        assert cu.cuGraphLaunch(execs[k], torch_stream_handle(None))[0] == OK

    return lib, launch


def _instantiate_ms(graphs: dict[str, Any], rounds: int = 3) -> dict[str, float]:
    """cuGraphInstantiate + cuGraphUpload of each named CUgraph, the best of `rounds`, each exec
    destroyed again (interleaved: the process's state drifts)."""
    import time

    from ember.runtime.graphs.rebuild import instantiate

    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, graph in graphs.items():
            t = time.perf_counter()
            ex = instantiate(graph)
            assert cu.cuGraphUpload(ex, torch_stream_handle(None))[0] == OK
            assert cu.cuStreamSynchronize(torch_stream_handle(None))[0] == OK
            ms = (time.perf_counter() - t) * 1e3
            cu.cuGraphExecDestroy(ex)
            best[name] = min(ms, best.get(name, ms))
    return best


def _context_state() -> dict[str, int]:
    """The context's limits and cache configs: what an eager step may change for every launch."""
    lim = cu.CUlimit
    state = {
        n: int(cu.cuCtxGetLimit(getattr(lim, n))[1])
        for n in (
            "CU_LIMIT_STACK_SIZE",
            "CU_LIMIT_MALLOC_HEAP_SIZE",
            "CU_LIMIT_PRINTF_FIFO_SIZE",
            "CU_LIMIT_PERSISTING_L2_CACHE_SIZE",
            "CU_LIMIT_MAX_L2_FETCH_GRANULARITY",
        )
    }
    state["cache_config"] = int(cu.cuCtxGetCacheConfig()[1])
    return state


def _extra_execs(w: Any, lib: Any, launch: Any, sizes: tuple[int, ...], out: dict[str, Any]) -> None:
    """The restored graphs' TPOT while more and more execs (of the largest size's graph,
    instantiated and uploaded) are alive in the context, then after they are destroyed."""
    from ember.runtime.graphs.rebuild import instantiate

    graph = lib.graph(lib.key_index((max(sizes),)))
    extra: list[Any] = []
    out["0"] = {b: tpot_ms(w, launch, b) for b in sizes}
    for n in (8, 16, 32, 64):
        while len(extra) < n:
            ex = instantiate(graph)
            assert cu.cuGraphUpload(ex, torch_stream_handle(None))[0] == OK
            extra.append(ex)
        out[str(n)] = {b: tpot_ms(w, launch, b) for b in sizes}
    for ex in extra:
        cu.cuGraphExecDestroy(ex)
    out["destroyed"] = {b: tpot_ms(w, launch, b) for b in sizes}


def _stages(w: Any, launch: Any, sizes: tuple[int, ...], out: dict[str, Any]) -> None:
    """The restored graphs' TPOT as this process does more of what a native process does first:
    nothing yet (each size twice, alternating), a bf16 randn, a cuBLAS matmul, one eager decode
    step of each size."""
    import torch

    def measure(stage: str, rounds: int = 1) -> None:
        out[stage] = {
            "tpot_ms": [{b: tpot_ms(w, launch, b) for b in sizes} for _ in range(rounds)],
            "context": _context_state(),
        }

    measure("after_load", rounds=2)
    with torch.no_grad():
        a = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        measure("after_randn")
        torch.matmul(a, a.t())
        torch.cuda.synchronize()
        measure("after_cublas_matmul")
        for b in sizes:
            w.step(b)
        torch.cuda.synchronize()
        measure("after_eager_steps")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("identity")
    ap.add_argument("--sizes", default="1,64")
    ap.add_argument("--out", default="")
    ap.add_argument("--extra-execs", action="store_true", help="first: TPOT with more execs alive")
    a = ap.parse_args()
    sizes = tuple(int(s) for s in a.sizes.split(","))
    loaded = load_workload(a.store, a.identity, log=lambda m: None)
    w, lib = loaded.workload, loaded.library
    for b in sizes:  # every size on its own exec, as a serving pod runs once settled
        loaded.launch((b,))
    lib.own.settle()
    out: dict[str, Any] = {"sizes": sizes, "tpot_ms": {}, "stages": {}, "extra_execs": {}}
    if a.extra_execs:
        _extra_execs(w, lib, loaded.launch, sizes, out["extra_execs"])
    _stages(w, loaded.launch, sizes, out["stages"])
    launches = {"restored": loaded.launch}
    w.capture(sizes, capture_error_mode="thread_local")
    launches["captured"] = lambda k: w.graphs[k].replay()
    keep, launches["rebuilt-runtime"] = _rebuilt_with_runtime_functions(w, sizes)
    for _ in range(2):  # interleaved rounds (clocks drift), best kept
        for name, launch in launches.items():
            for b in sizes:
                t = tpot_ms(w, launch, b)
                out["tpot_ms"].setdefault(name, {})[b] = min(t, out["tpot_ms"].get(name, {}).get(b, t))
    out["instantiate_ms"] = {
        str(b): _instantiate_ms({
            "restored": lib.graph(lib.key_index((b,))),
            "captured": w.graphs[(b,)].raw_cuda_graph(),
            "rebuilt-runtime": keep.graph(keep.key_index((b,))),
        })
        for b in sizes
    }
    profiles = {name: {str(b): profile_steps(launch, b) for b in sizes} for name, launch in launches.items()}
    out["gaps"] = {
        name: compare(profiles["restored"], p) for name, p in profiles.items() if name != "restored"
    }
    for g in out["gaps"].values():  # the summaries are what matters here
        for v in g.values():
            v.pop("most_faster_in_b"), v.pop("most_slower_in_b")
    text = json.dumps(out, indent=1, default=str)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)
    keep.close()


if __name__ == "__main__":
    main()
