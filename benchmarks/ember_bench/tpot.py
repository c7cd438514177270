"""The TPOT controls the bench's children run beside native vs restored (docs/runtime.md, TPOT)."""

from __future__ import annotations

from typing import Any


def reinstantiated(w: Any, batches: list[int]) -> dict[str, float]:
    """Control: the captured graphs, instantiated the way LOAD instantiates (cuGraphInstantiate,
    no flags) and launched with cuGraphLaunch, instead of torch's replay()."""
    from cuda.bindings import driver as cu

    from ember.runtime.graphs.driver import OK, torch_stream_handle
    from ember.runtime.graphs.rebuild import instantiate
    from ember.runtime.proof.replay import tpot_ms

    execs: dict[tuple[int, ...], Any] = {
        (b,): instantiate(cu.CUgraph(int(w.graphs[(b,)].raw_cuda_graph()))) for b in batches
    }

    def launch(k: tuple[int, ...]) -> None:
        assert cu.cuGraphLaunch(execs[k], torch_stream_handle())[0] == OK

    try:
        return {str(b): tpot_ms(w, launch, b) for b in batches}
    finally:
        for ex in execs.values():
            cu.cuGraphExecDestroy(ex)


def same_process(w: Any, launch: Any, batches: list[int]) -> dict[str, dict[str, float]]:
    """The restored graphs against torch capturing the same sizes in THIS process, in alternating
    rounds, best kept. A process with few graph execs instantiated runs every graph with shorter
    gaps between kernels, and leaves that state once it instantiates more; across
    processes the restored step then looks faster than native while the graphs are not
    (benchmarks/results/tpot-explained-h100-20261125.md). This ratio compares like with like."""
    from ember.runtime.proof.replay import tpot_ms

    w.capture(tuple(batches), capture_error_mode="thread_local")
    ways = {"restored": launch, "captured": lambda k: w.graphs[k].replay()}
    best: dict[str, dict[str, float]] = {n: {} for n in ways}
    for _ in range(2):
        for name, way in ways.items():
            for b in batches:
                t = tpot_ms(w, way, b)
                best[name][str(b)] = min(t, best[name].get(str(b), t))
    return best
