"""Diagnose a failed proof: which graphs differ, and why (run under libember in save mode).

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=save EMBER_ARM=manual python3 benchmarks/diag_restore.py [sizes]

Per graph key: is the NATIVE graph deterministic (two replays from one state), and does a
rebuilt graph match it with (a) the captured function handles, (b) libember's catalog
functions, (c) fresh instances of the images (what a LOAD process gets). For a key where (b) or
(c) fails while (a) passes, bisect the kernels whose substitution changes the output.
"""

from __future__ import annotations

import json
import sys

import torch
from cuda.bindings import driver as cu

from ember.engines.decode.model import DecodeWorkload
from ember.runtime.graphs.driver import check
from ember.runtime.graphs.kernels import NativeResolver
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.session import native_session


def main() -> None:
    sizes = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,16,24,32,64,256").split(","))
    ip = native_session("save")
    assert ip is not None, "run under libember (save mode)"
    import os

    w = DecodeWorkload.from_name("llama3-8b", sizes=sizes, deterministic=os.environ.get("DIAG_DET") == "1")
    w.build()
    ip.capture_begin()
    w.capture()
    ip.capture_end()
    walker = GraphWalker(NativeResolver(ip))
    gs = walker.graph_set([walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in w.sizes])
    n = len(gs.kernels)
    orig = [0] * n
    for (func, _kern), k in walker._by_handle.items():
        orig[k] = orig[k] or func
    catalog = {e["hash"]: e for e in ip.catalog()}
    natf = [int(ip.function(r.image, r.name)) for r in gs.kernels]
    out: dict = {
        "kernels": n,
        "handle_differs": [gs.kernels[i].name[:90] for i in range(n) if natf[i] != orig[i]],
    }
    libs: dict[str, object] = {}
    fresh = [0] * n
    fresh_err = {}
    for i, r in enumerate(gs.kernels):
        try:
            if r.image not in libs:
                libs[r.image] = check(
                    cu.cuLibraryLoadData(ip.image_bytes(r.image), [], [], 0, [], [], 0), "cuLibraryLoadData"
                )
            k = check(cu.cuLibraryGetKernel(libs[r.image], r.name.encode()), "cuLibraryGetKernel")
            fresh[i] = int(check(cu.cuKernelGetFunction(k), "cuKernelGetFunction"))
        except Exception as exc:  # report and keep the catalog's function
            fresh_err[r.name[:80]] = str(exc)[:120]
            fresh[i] = natf[i]
    out["fresh_errors"] = fresh_err
    state = w.state_tensors()

    def run(fns: list[int], key: tuple[int, ...]) -> list[torch.Tensor]:
        lib = GraphLibrary(gs, fns)
        lib.apply_function_attrs()
        i = lib.key_index(key)
        lib.dedicate(i)
        lib.launch(i)
        torch.cuda.synchronize()
        res = [o.clone() for o in w.outs[key]]
        lib.close()
        return res

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))

    # Rebuild fidelity: walk the rebuilt graphs and compare every node and edge with the capture.
    from ember.archive import graph_table as fmt

    lib0 = GraphLibrary(fmt.decode(fmt.encode(gs)), orig)  # the fast (table) path LOAD uses
    fidelity = {}
    for gi, g in enumerate(gs.graphs):
        rw = GraphWalker(NativeResolver(ip))
        back = rw.walk(lib0.graph(gi), g.key)
        problems = []
        if len(back.nodes) != len(g.nodes):
            problems.append(f"node count {len(back.nodes)} vs {len(g.nodes)}")
        for ni, (a, b) in enumerate(zip(g.nodes, back.nodes, strict=False)):
            if a.type != b.type:
                problems.append(f"node {ni} type {b.type} vs {a.type}")
                continue
            if a.type == 0:
                pa, pb = a.params, b.params
                fields = ("grid", "block", "shared_mem", "args", "arg_offsets", "arg_sizes", "extra", "attrs")
                for f in fields:
                    if getattr(pa, f) != getattr(pb, f):
                        problems.append(f"node {ni} {f} differs ({gs.kernels[pa.kernel].name[:50]})")
                if gs.kernels[pa.kernel] != rw.kernels[pb.kernel]:
                    problems.append(f"node {ni} kernel differs")
            elif a.params != b.params:
                problems.append(f"node {ni} params differ: {a.params} vs {b.params}")
        if back.edges != g.edges:
            problems.append(f"edges differ ({len(back.edges)} vs {len(g.edges)})")
        fidelity[str(g.key[0])] = problems[:8]
    lib0.close()
    out["fidelity"] = fidelity
    print(json.dumps({"fidelity": fidelity})[:3000], flush=True)

    per = {}
    for key in [(b,) for b in w.sizes]:
        snap = [s.clone() for s in state]

        def restore(snap: list[torch.Tensor] = snap) -> None:
            for s, v in zip(state, snap, strict=True):
                s.copy_(v)

        w.graphs[key].replay()
        torch.cuda.synchronize()
        ref = [o.clone() for o in w.outs[key]]
        restore()
        w.graphs[key].replay()
        torch.cuda.synchronize()
        det = same(ref, [o.clone() for o in w.outs[key]])
        row = {"native_deterministic": det}
        restore()
        _err, clone = cu.cuGraphClone(cu.CUgraph(w.graphs[key].raw_cuda_graph()))
        ex = check(cu.cuGraphInstantiate(clone, 0), "instantiate clone")
        check(cu.cuGraphLaunch(ex, cu.CUstream(torch.cuda.current_stream().cuda_stream)), "launch clone")
        torch.cuda.synchronize()
        row["clone"] = same(ref, [o.clone() for o in w.outs[key]])
        cu.cuGraphExecDestroy(ex)
        cu.cuGraphDestroy(clone)
        for label, fns in (("orig", orig), ("catalog", natf), ("fresh", fresh)):
            restore()
            got = run(fns, key)
            row[label] = same(ref, got)
            if not row[label]:
                row[label + "_maxdiff"] = float((got[0].float() - ref[0].float()).abs().max())
        used = sorted({nd.params.kernel for nd in gs.graphs[w.sizes.index(key[0])].nodes if nd.type == 0})
        for label, fns in (("catalog", natf), ("fresh", fresh)):
            if row["orig"] and not row[label]:
                bad = []
                for j in used:
                    if fns[j] == orig[j]:
                        continue
                    trial = list(orig)
                    trial[j] = fns[j]
                    restore()
                    if not same(ref, run(trial, key)):
                        im = catalog.get(gs.kernels[j].image, {})
                        bad.append(
                            {
                                "kernel": gs.kernels[j].name[:100],
                                "image_kind": im.get("kind"),
                                "api": im.get("api"),
                                "size": im.get("size"),
                            }
                        )
                row[label + "_culprits"] = bad
        restore()
        per[str(key[0])] = row
        print(json.dumps({str(key[0]): row})[:1500], flush=True)
    out["per_size"] = per
    # Do graphs read window memory that something outside the graphs initialised? Poison each
    # window allocation (hex log: E seq kind phase addr size align aux caller) and replay.
    log = ip.export_alloc_log().decode().split()
    allocs = []
    for j, word in enumerate(log):
        if word == "E" and log[j + 3] == "window" and log[j + 2] in ("alloc", "async", "pool", "pitch"):
            allocs.append((int(log[j + 4], 16), int(log[j + 5], 16), log[j + 8]))
    out["window_allocs"] = [(hex(a), n, c) for a, n, c in allocs][:40]
    key = (max(w.sizes),)
    snap = [s_.clone() for s_ in state]

    def restore2() -> None:
        for s_, v in zip(state, snap, strict=True):
            s_.copy_(v)

    w.graphs[key].replay()
    torch.cuda.synchronize()
    ref = [o.clone() for o in w.outs[key]]
    saved_bytes = {}
    culprits = []
    for a, n, caller in allocs:
        keep = torch.empty(n, dtype=torch.uint8, device="cuda")
        check(cu.cuMemcpyDtoD(keep.data_ptr(), a, n), "save window bytes")
        check(cu.cuMemsetD8(a, 0xA5, n), "poison")
        restore2()
        w.graphs[key].replay()
        torch.cuda.synchronize()
        ok = same(ref, [o.clone() for o in w.outs[key]])
        check(cu.cuMemcpyDtoD(a, keep.data_ptr(), n), "restore window bytes")
        torch.cuda.synchronize()
        if not ok:
            nz = int((keep != 0).sum())
            culprits.append({"addr": hex(a), "size": n, "caller": caller, "nonzero_bytes": nz})
        del keep
    saved_bytes["count"] = len(allocs)
    out["window_culprits"] = culprits
    print(json.dumps(out, indent=1)[:8000], flush=True)


if __name__ == "__main__":
    main()
