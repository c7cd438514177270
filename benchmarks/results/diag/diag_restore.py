"""Diagnose a failed proof: which graphs differ, and why (run under libember in save mode).

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=save EMBER_ARM=manual python3 benchmarks/results/diag/diag_restore.py [sizes]

Per graph key: is the NATIVE graph deterministic (two replays from one state), and does a
rebuilt graph match it with (a) the captured function handles, (b) libember's catalog
functions, (c) fresh instances of the images (what a LOAD process gets). For a key where (b) or
(c) fails while (a) passes, bisect the kernels whose substitution changes the output.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from cuda.bindings import driver as cu

from ember.engines.decode.model import DecodeWorkload
from ember.runtime.graphs.driver import check
from ember.runtime.graphs.kernels import NativeResolver
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.session import native_session

Key = tuple[int, ...]
KERNEL = 0  # node type of a kernel node
PARAM_FIELDS = ("grid", "block", "shared_mem", "args", "arg_offsets", "arg_sizes", "extra", "attrs")


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def restore_state(state: list[torch.Tensor], snap: list[torch.Tensor]) -> None:
    for s, v in zip(state, snap, strict=True):
        s.copy_(v)


def replay_outputs(w: DecodeWorkload, key: Key) -> list[torch.Tensor]:
    w.graphs[key].replay()
    torch.cuda.synchronize()
    return [o.clone() for o in w.outs[key]]


def fresh_functions(ip: Any, gs: Any, natf: list[int]) -> tuple[list[int], dict[str, str]]:
    """Each kernel from a fresh cuLibraryLoadData of its image (what a LOAD process gets); the
    catalog's function where that fails (the failures are returned)."""
    libs: dict[str, object] = {}
    fresh = [0] * len(gs.kernels)
    errors = {}
    for i, r in enumerate(gs.kernels):
        try:
            if r.image not in libs:
                libs[r.image] = check(
                    cu.cuLibraryLoadData(ip.image_bytes(r.image), [], [], 0, [], [], 0), "cuLibraryLoadData"
                )
            k = check(cu.cuLibraryGetKernel(libs[r.image], r.name.encode()), "cuLibraryGetKernel")
            fresh[i] = int(check(cu.cuKernelGetFunction(k), "cuKernelGetFunction"))
        except Exception as exc:  # report and keep the catalog's function
            errors[r.name[:80]] = str(exc)[:120]
            fresh[i] = natf[i]
    return fresh, errors


def node_problems(gs: Any, rw: GraphWalker, g: Any, back: Any) -> list[str]:
    """How the graph walked back from a rebuild differs from the captured one, node by node."""
    problems = []
    if len(back.nodes) != len(g.nodes):
        problems.append(f"node count {len(back.nodes)} vs {len(g.nodes)}")
    for ni, (a, b) in enumerate(zip(g.nodes, back.nodes, strict=False)):
        if a.type != b.type:
            problems.append(f"node {ni} type {b.type} vs {a.type}")
            continue
        if a.type == KERNEL:
            pa, pb = a.params, b.params
            for f in PARAM_FIELDS:
                if getattr(pa, f) != getattr(pb, f):
                    problems.append(f"node {ni} {f} differs ({gs.kernels[pa.kernel].name[:50]})")
            if gs.kernels[pa.kernel] != rw.kernels[pb.kernel]:
                problems.append(f"node {ni} kernel differs")
        elif a.params != b.params:
            problems.append(f"node {ni} params differ: {a.params} vs {b.params}")
    if back.edges != g.edges:
        problems.append(f"edges differ ({len(back.edges)} vs {len(g.edges)})")
    return problems


def rebuild_fidelity(ip: Any, gs: Any, orig: list[int]) -> dict[str, list[str]]:
    """Walk the graphs rebuilt through the table path LOAD uses and compare every node and edge
    with the capture."""
    from ember.archive import graph_table as fmt

    lib0 = GraphLibrary(fmt.decode(fmt.encode(gs)), orig)
    fidelity = {}
    for gi, g in enumerate(gs.graphs):
        rw = GraphWalker(NativeResolver(ip))
        back = rw.walk(lib0.graph(gi), g.key)
        fidelity[str(g.key[0])] = node_problems(gs, rw, g, back)[:8]
    lib0.close()
    return fidelity


def clone_replays_same(w: DecodeWorkload, key: Key, ref: list[torch.Tensor]) -> bool:
    """A driver clone of the captured graph, instantiated and launched: SAVE's outputs?"""
    _err, clone = cu.cuGraphClone(cu.CUgraph(w.graphs[key].raw_cuda_graph()))
    ex = check(cu.cuGraphInstantiate(clone, 0), "instantiate clone")
    check(cu.cuGraphLaunch(ex, cu.CUstream(torch.cuda.current_stream().cuda_stream)), "launch clone")
    torch.cuda.synchronize()
    ok = same(ref, [o.clone() for o in w.outs[key]])
    cu.cuGraphExecDestroy(ex)
    cu.cuGraphDestroy(clone)
    return ok


class Rebuilds:
    """Rebuild one key's graph with a given function per kernel, launch it, return its outputs."""

    def __init__(self, w: DecodeWorkload, gs: Any, state: list[torch.Tensor]) -> None:
        self.w, self.gs, self.state = w, gs, state

    def run(self, fns: list[int], key: Key) -> list[torch.Tensor]:
        lib = GraphLibrary(self.gs, fns)
        i = lib.key_index(key)
        lib.own.instantiate(i)
        lib.launch(i)
        torch.cuda.synchronize()
        res = [o.clone() for o in self.w.outs[key]]
        lib.close()
        return res

    def culprits(self, key: Key, ref: list[torch.Tensor], snap: list[torch.Tensor], orig: list[int],
                 fns: list[int], catalog: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The kernels whose function from `fns` alone (the rest `orig`) changes the key's outputs."""
        gs = self.gs
        used = sorted({nd.params.kernel for nd in gs.graphs[self.w.sizes.index(key[0])].nodes
                       if nd.type == KERNEL})
        bad = []
        for j in used:
            if fns[j] == orig[j]:
                continue
            trial = list(orig)
            trial[j] = fns[j]
            restore_state(self.state, snap)
            if not same(ref, self.run(trial, key)):
                im = catalog.get(gs.kernels[j].image, {})
                bad.append({"kernel": gs.kernels[j].name[:100], "image_kind": im.get("kind"),
                            "api": im.get("api"), "size": im.get("size")})
        return bad


def compare_key(rb: Rebuilds, key: Key, functions: dict[str, list[int]],
                catalog: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One key: native determinism, a driver clone, and rebuilds with each function set; for a
    set that fails where the captured handles pass, the kernels to blame."""
    w, state = rb.w, rb.state
    snap = [s.clone() for s in state]
    ref = replay_outputs(w, key)
    restore_state(state, snap)
    row: dict[str, Any] = {"native_deterministic": same(ref, replay_outputs(w, key))}
    restore_state(state, snap)
    row["clone"] = clone_replays_same(w, key, ref)
    for label, fns in functions.items():
        restore_state(state, snap)
        got = rb.run(fns, key)
        row[label] = same(ref, got)
        if not row[label]:
            row[label + "_maxdiff"] = float((got[0].float() - ref[0].float()).abs().max())
    for label in ("catalog", "fresh"):
        if row["orig"] and not row[label]:
            blame = rb.culprits(key, ref, snap, functions["orig"], functions[label], catalog)
            row[label + "_culprits"] = blame
    restore_state(state, snap)
    return row


def window_allocations(ip: Any) -> list[tuple[int, int, str]]:
    """(address, size, caller) of each capture-window allocation of the allocation log (hex log:
    E seq kind phase addr size align aux caller)."""
    log = ip.export_alloc_log().decode().split()
    allocs = []
    for j, word in enumerate(log):
        if word == "E" and log[j + 3] == "window" and log[j + 2] in ("alloc", "async", "pool", "pitch"):
            allocs.append((int(log[j + 4], 16), int(log[j + 5], 16), log[j + 8]))
    return allocs


def window_culprits(w: DecodeWorkload, state: list[torch.Tensor],
                    allocs: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    """Do graphs read window memory that something outside the graphs initialised? Poison each
    window allocation in turn, replay the largest size, and name those that change its outputs."""
    key = (max(w.sizes),)
    snap = [s.clone() for s in state]
    ref = replay_outputs(w, key)
    culprits = []
    for a, n, caller in allocs:
        keep = torch.empty(n, dtype=torch.uint8, device="cuda")
        check(cu.cuMemcpyDtoD(keep.data_ptr(), a, n), "save window bytes")
        check(cu.cuMemsetD8(a, 0xA5, n), "poison")
        restore_state(state, snap)
        ok = same(ref, replay_outputs(w, key))
        check(cu.cuMemcpyDtoD(a, keep.data_ptr(), n), "restore window bytes")
        torch.cuda.synchronize()
        if not ok:
            nz = int((keep != 0).sum())
            culprits.append({"addr": hex(a), "size": n, "caller": caller, "nonzero_bytes": nz})
        del keep
    return culprits


def captured_graph_set(ip: Any, w: DecodeWorkload) -> tuple[Any, list[int]]:
    """Build and capture `w` under libember (save mode) and walk its graphs: the GraphSet and, per
    kernel, the function handle the capture used (diag_union_members.py too)."""
    w.build()
    ip.capture_begin()
    w.capture()
    ip.capture_end()
    walker = GraphWalker(NativeResolver(ip))
    gs = walker.graph_set([walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in w.sizes])
    orig = [0] * len(gs.kernels)
    for (func, _kern), k in walker._by_handle.items():
        orig[k] = orig[k] or func
    return gs, orig


def main() -> None:
    sizes = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,16,24,32,64,256").split(","))
    ip = native_session("save")
    assert ip is not None, "run under libember (save mode)"
    w = DecodeWorkload.from_name("llama3-8b", sizes=sizes, deterministic=os.environ.get("DIAG_DET") == "1")
    gs, orig = captured_graph_set(ip, w)
    n = len(gs.kernels)
    catalog = {e["hash"]: e for e in ip.catalog()}
    natf = [int(ip.function(r.image, r.name)) for r in gs.kernels]
    fresh, fresh_err = fresh_functions(ip, gs, natf)
    out: dict[str, Any] = {
        "kernels": n,
        "handle_differs": [gs.kernels[i].name[:90] for i in range(n) if natf[i] != orig[i]],
        "fresh_errors": fresh_err,
    }
    out["fidelity"] = rebuild_fidelity(ip, gs, orig)
    print(json.dumps({"fidelity": out["fidelity"]})[:3000], flush=True)

    rb = Rebuilds(w, gs, w.state_tensors())
    functions = {"orig": orig, "catalog": natf, "fresh": fresh}
    per = {}
    for key in [(b,) for b in w.sizes]:
        per[str(key[0])] = row = compare_key(rb, key, functions, catalog)
        print(json.dumps({str(key[0]): row})[:1500], flush=True)
    out["per_size"] = per
    allocs = window_allocations(ip)
    out["window_allocs"] = [(hex(a), n, c) for a, n, c in allocs][:40]
    out["window_culprits"] = window_culprits(w, rb.state, allocs)
    print(json.dumps(out, indent=1)[:8000], flush=True)


if __name__ == "__main__":
    main()
