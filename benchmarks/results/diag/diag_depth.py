"""Why are native Llama-3-8B decode graphs not bit-stable at 32 layers? (pure torch, no libember)

    python3 benchmarks/results/diag/diag_depth.py [sizes] [layer counts] [probed sizes]  # default: 1,24,64  8,32

One model is built; for each layer count the first L layers are captured (own pool, shared
by the sizes, like an engine) and each hypothesis is tested on its own:
  replays   - the graph replayed 6 times from one full state (ids, pos, step, KV, history)
  pool      - the same, with every block of the graph pool filled with 0x00 / 0xA5 / random
              bytes before the replay: a graph whose output changes reads pool memory before
              it writes it (read-before-write shared between graphs of one pool)
  eager     - the step run eagerly 4 times from the same state
  no_pdl    - a clone of the captured graph with every programmatic edge made a default edge,
              replayed 6 times: stable here but not in `replays` = a programmatic-launch race
  finite    - NaN/inf counts and max |logit|
  decode    - 64 greedy steps at the smallest size twice, other sizes replayed in between
  bench     - the bench's native sequence (TPOT loops, then 256-step decodes at 1/8/64 twice):
              first differing step per batch; for B=1, per-step logits fingerprints of two
              decodes name the first step whose logits differ and whether its inputs were equal
DIAG_EMBER=1 runs it under libember (save mode, armed, capture window around the captures):
run it as `LD_PRELOAD=$EMBER_LIB EMBER_MODE=save EMBER_ARM=manual DIAG_EMBER=1 python3 ...`.
One JSON line per finding, flushed as it comes.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable

import torch
from cuda.bindings import driver as cu
from torch import nn

from ember.engines.decode.model import DecodeWorkload, tensor_at
from ember.runtime.graphs.driver import add_dependencies, check, graph_edges, torch_stream_handle
from ember.runtime.proof.measures import first_divergence
from ember.runtime.proof.replay import decode_trace, fingerprint, tpot_ms

REPLAYS = 6


def emit(**kw: object) -> None:
    print(json.dumps(kw, default=str), flush=True)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def pool_blocks(pool: tuple[int, int]) -> list[torch.Tensor]:
    """uint8 views over every segment of one graph pool."""
    segs = torch.cuda.memory._snapshot()["segments"]
    return [
        tensor_at(s["address"], (s["total_size"],), (1,), "uint8")
        for s in segs
        if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool)
    ]


def strip_pdl(graph: torch.cuda.CUDAGraph) -> tuple[object, int]:
    """An exec of a clone of the captured graph whose programmatic edges are default edges."""
    clone = check(cu.cuGraphClone(graph.raw_cuda_graph()), "cuGraphClone")
    frm, to, data = graph_edges(clone)
    pdl = [j for j in range(len(frm)) if data[8 * j + 2] != 0]
    if pdl:
        rm = ctypes.CDLL("libcuda.so.1").cuGraphRemoveDependencies_v2
        rm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_size_t]
        rm.restype = ctypes.c_int
        a = (ctypes.c_uint64 * len(pdl))(*[frm[j] for j in pdl])
        b = (ctypes.c_uint64 * len(pdl))(*[to[j] for j in pdl])
        d = (ctypes.c_uint8 * (8 * len(pdl))).from_buffer_copy(b"".join(data[8 * j : 8 * j + 8] for j in pdl))
        rc = rm(int(clone), a, b, d, len(pdl))
        if rc:
            raise RuntimeError(f"cuGraphRemoveDependencies_v2: {rc}")
        add_dependencies(clone, [frm[j] for j in pdl], [to[j] for j in pdl], None)
    left = sum(graph_edges(clone)[2][8 * j + 2] != 0 for j in range(len(frm)))
    exe = check(cu.cuGraphInstantiate(clone, 0), "cuGraphInstantiate")
    return exe, len(pdl) - left


def main() -> None:
    sizes = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,24,64").split(","))
    depths = tuple(int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "8,32").split(","))
    probed = tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else sizes
    ip = None
    if os.environ.get("DIAG_EMBER") == "1":
        from ember.runtime.session import native_session

        ip = native_session("save")
    torch.cuda.init()
    w = DecodeWorkload.from_name("llama3-8b", sizes=sizes)
    w.build()
    assert w.model is not None
    full = list(w.model.layers)
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, sizes=sizes, depths=depths)
    state = [w.ids, w.pos, w.step_no, w.kcache, w.vcache, w.history]
    for depth in depths:
        w.model.layers = nn.ModuleList(full[:depth])
        if ip is not None:
            ip.capture_begin()
        pool = _capture(w, sizes)
        if ip is not None:
            ip.capture_end()
        probe_depth(w, depth, pool, probed, state)
        bench_sequence(w, depth, [b for b in (1, 8, 64) if b in sizes])
        w.graphs.clear()
        w.outs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _capture(w: DecodeWorkload, sizes: tuple[int, ...]) -> tuple[int, int]:
    pool = torch.cuda.graph_pool_handle()
    w.graphs.clear()
    w.outs.clear()
    with torch.no_grad():
        for b in sorted(sizes, reverse=True):
            w.step(b)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=pool):
                w.outs[(b,)] = w.step(b)
            w.graphs[(b,)] = g
    torch.cuda.synchronize()
    return pool


def probe_depth(
    w: DecodeWorkload, depth: int, pool: tuple[int, int], probed: tuple[int, ...], state: list[torch.Tensor]
) -> None:
    w.reset_state(5)
    for _ in range(3):
        w.graphs[(max(probed),)].replay()
    snap = [t.clone() for t in state]
    blocks = pool_blocks(pool)
    stream = torch_stream_handle()

    def run(
        launch: Callable[[], None], b: int, before: Callable[[], object] | None = None
    ) -> list[torch.Tensor]:
        for t, v in zip(state, snap, strict=True):
            t.copy_(v)
        if before:
            before()
        launch()
        torch.cuda.synchronize()
        return [o.clone() for o in w.outs[(b,)]]

    fills = pool_fills(blocks)
    for b in probed:
        g = w.graphs[(b,)]
        ref = run(g.replay, b)
        logits = ref[0].float()
        rec: dict[str, object] = {
            "depth": depth,
            "size": b,
            "pool_blocks": len(blocks),
            "nan": int(torch.isnan(logits).sum()),
            "inf": int(torch.isinf(logits).sum()),
            "max_abs_logit": float(logits.abs().max()),
            "replays_stable": sum(same(ref, run(g.replay, b)) for _ in range(REPLAYS - 1)),
        }
        rec["pool_fill_same"] = {k: same(ref, run(g.replay, b, f)) for k, f in fills.items()}

        def eager(b: int = b) -> None:
            with torch.no_grad():
                out = w.step(b)
            for o, r in zip(w.outs[(b,)], out, strict=True):
                o.copy_(r)

        e = [run(eager, b) for _ in range(4)]
        rec["eager_stable"] = sum(same(e[0], x) for x in e[1:])
        rec["eager_equals_graph"] = same(e[0], ref)
        exe, made_default = strip_pdl(g)

        def launch(exe: object = exe) -> None:
            check(cu.cuGraphLaunch(exe, stream), "cuGraphLaunch")

        n = [run(launch, b) for _ in range(REPLAYS)]
        rec["programmatic_edges_made_default"] = made_default
        rec["no_pdl_stable"] = sum(same(n[0], x) for x in n[1:])
        rec["no_pdl_equals_graph"] = same(n[0], ref)
        emit(**rec)
    decode_repeat(w, depth, probed)


def pool_fills(blocks: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """Ways to overwrite every block of the graph pool before a replay."""
    return {
        "zero": lambda: [x.zero_() for x in blocks],
        "a5": lambda: [x.fill_(0xA5) for x in blocks],
        "rand": lambda: [x.random_(0, 256) for x in blocks],
    }


def decode_repeat(w: DecodeWorkload, depth: int, probed: tuple[int, ...]) -> None:
    """Decode twice at the smallest size with the other graphs replayed in between."""
    b0 = min(probed)
    hist = []
    for _ in range(2):
        w.reset_state(11)
        for _ in range(64):
            w.graphs[(b0,)].replay()
        torch.cuda.synchronize()
        hist.append(w.history[:64, :b0].clone())
        for b in probed:
            if b != b0:
                w.graphs[(b,)].replay()
    emit(depth=depth, decode_size=b0, decode_repeat_identical=bool(torch.equal(hist[0], hist[1])))


def bench_sequence(w: DecodeWorkload, depth: int, batches: list[int]) -> None:
    launch = lambda k: w.graphs[k].replay()  # noqa: E731
    for b in batches:
        tpot_ms(w, launch, b)
    first = {str(b): decode_trace(w, launch, b) for b in batches}
    again = {str(b): decode_trace(w, launch, b) for b in batches}
    emit(
        depth=depth,
        bench_first_divergence={b: first_divergence(first[b]["steps"], again[b]["steps"]) for b in first},
    )
    if not batches:
        return
    b = batches[0]
    runs = []
    for _ in range(2):
        w.reset_state(11)
        per_step = []
        for _ in range(256):
            ids = w.ids[:b].clone()
            pos = w.pos[:b].clone()
            w.graphs[(b,)].replay()
            per_step.append((ids, pos, fingerprint([w.outs[(b,)][0]])[0]))
        runs.append(per_step)
    diff = next((i for i in range(256) if runs[0][i][2] != runs[1][i][2]), None)
    rec: dict[str, object] = {"depth": depth, "size": b, "first_logits_difference": diff}
    if diff is not None:
        rec["inputs_equal_there"] = bool(
            torch.equal(runs[0][diff][0], runs[1][diff][0])
            and torch.equal(runs[0][diff][1], runs[1][diff][1])
        )
        rec["pos_there"] = runs[0][diff][1].tolist()
    emit(**rec)


if __name__ == "__main__":
    main()
