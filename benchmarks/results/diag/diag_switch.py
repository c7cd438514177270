"""Where a template switch goes: how many nodes differ between two graphs of a group, and what
setting only those on the exec costs next to cuGraphExecUpdate of the whole graph.

    gcc -O2 -shared -fPIC -I<cuda.h dir> benchmarks/results/diag/diag_switch_set.c -o /tmp/dss.so -ldl
    LD_PRELOAD=$EMBER_LIB EMBER_MODE=load EMBER_ARM=manual \
        python benchmarks/results/diag/diag_switch.py STORE IDENTITY OUT.json /tmp/dss.so

For each group with more than one member and each switch a -> b in member order: nodes, changed
nodes (GraphTable.changed_nodes), cuGraphExecUpdate ms, the node-by-node set of the changed nodes
(read params / set params ms, diag_switch_set.c), the same for every kernel/memset node, and
whether the template's outputs after the partial set are bitwise those after the full update.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from cuda.bindings import driver as cu

from ember.engines.decode.adapter import load_workload
from ember.engines.decode.model import fingerprint
from ember.runtime.graphs.driver import check, graph_nodes

KINDS = tuple(
    int(getattr(cu.CUgraphNodeType, f"CU_GRAPH_NODE_TYPE_{t}")) for t in ("KERNEL", "MEMSET", "MEMCPY")
)


def nodes_of(graph: object) -> np.ndarray:
    return np.array([int(x) for x in graph_nodes(graph)], dtype=np.uint64)


# long: one diagnostic run, read top to bottom: the per-switch steps share the loaded library,
# the template's node arrays and the C helper
def main() -> None:
    store, identity, out_path, helper = sys.argv[1:5]
    loaded = load_workload(store, identity, perturb_first=True, log=lambda m: None)
    lib, w = loaded.library, loaded.workload
    table: Any = lib.source  # a LOADed library reads the archive's GraphTable (node_types, changed_nodes)
    lib.own.hot_after = 0
    h = ctypes.CDLL(helper)
    h.set_nodes.restype = ctypes.c_int64
    h.set_nodes.argtypes = [
        ctypes.c_uint64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint64,
        ctypes.c_void_p,
    ]
    ctx = int(lib.ctx)

    def put(exec_: Any, dst: np.ndarray, src: np.ndarray, types: np.ndarray) -> tuple[float, float]:
        times = (ctypes.c_int64 * 2)()
        dst, src = np.ascontiguousarray(dst), np.ascontiguousarray(src)
        types = np.ascontiguousarray(types, dtype=np.int32)
        rc = h.set_nodes(
            int(exec_), dst.ctypes.data, src.ctypes.data, types.ctypes.data, len(dst), ctx, times
        )
        if rc:
            raise RuntimeError(f"set_nodes failed at {rc}")
        return times[0] / 1e6, times[1] / 1e6

    def outputs_after(b: int) -> list[int]:
        w.reset_state(7)
        lib.launch_template(b)
        torch.cuda.synchronize()
        return fingerprint(loaded.outputs[lib.keys[b]])

    def step_ms(exec_: object, n: int = 20) -> float:
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        w.reset_state(7)
        check(cu.cuGraphLaunch(exec_, stream), "cuGraphLaunch")
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            check(cu.cuGraphLaunch(exec_, stream), "cuGraphLaunch")
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    timed = 0
    rows: list[dict[str, Any]] = []
    for g in lib.groups:
        members = list(g.members)
        if len(members) < 2:
            continue
        tmpl = lib._templates[g.index]
        dst = nodes_of(lib.graph(g.template))
        types = np.asarray(table.node_types(g.template), dtype=np.int32)
        got = np.array(
            [int(check(cu.cuGraphNodeGetType(cu.CUgraphNode(int(x))), "type")) for x in dst], dtype=np.int32
        )
        if not np.array_equal(got, types):
            raise SystemExit(f"group {g.index}: cuGraphGetNodes order is not the archive's node order")
        settable = np.isin(types, KINDS)
        for a, b in zip(members, members[1:] + members[:1], strict=True):
            src = nodes_of(lib.graph(b))
            lib.switch(a)
            full_ms = lib.switch(b)
            want = outputs_after(b)
            lib.switch(a)
            t = time.perf_counter()
            changed = table.changed_nodes(b, a)
            diff_ms = (time.perf_counter() - t) * 1e3
            row = {"group": g.index, "a": lib.keys[a], "b": lib.keys[b], "nodes": len(dst)}
            row["changed"] = len(changed)
            if not settable[changed].all():
                what = sorted({int(t) for t in types[changed]} - set(KINDS))
                rows.append({**row, "skipped": f"changed node types {what}"})
                continue
            get_ms, set_ms = put(tmpl.handle, dst[changed], src[changed], types[changed])
            tmpl.holds = b
            same = outputs_after(b) == want
            steps = {}
            if timed < 4 and len(changed):  # step time: partial set vs full update vs own exec
                timed += 1
                steps["partial_set"] = step_ms(tmpl.handle)
                lib.switch(b)
                steps["updated"] = step_ms(tmpl.handle)
                steps["dedicated"] = step_ms(lib.own.instantiate(b))
                lib.own.drop(b)
            lib.switch(a)
            idx = np.nonzero(settable)[0]
            all_get, all_set = put(tmpl.handle, dst[idx], src[idx], types[idx])
            tmpl.holds = b
            rows.append(
                {
                    **row,
                    "changed_kernels": int((types[changed] == KINDS[0]).sum()),
                    "update_ms": full_ms,
                    "diff_ms": diff_ms,
                    "get_ms": get_ms,
                    "set_ms": set_ms,
                    "all_set_ms": all_set,
                    "all_get_ms": all_get,
                    "outputs_identical": same,
                    "step_ms": steps,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "skipped" not in r]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in ok) if ok else float("nan")

    summary = {
        "workload": loaded.archive.manifest.identity.model,
        "switches": len(ok),
        "skipped": len(rows) - len(ok),
        "all_outputs_identical": all(r["outputs_identical"] for r in ok),
        **{
            f"p50_{k}": med(k)
            for k in ("nodes", "changed", "update_ms", "diff_ms", "get_ms", "set_ms", "all_set_ms")
        },
    }
    print(json.dumps(summary), flush=True)
    with open(out_path, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1, default=list)


if __name__ == "__main__":
    main()
