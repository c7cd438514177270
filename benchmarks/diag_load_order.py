"""Why does a restored graph's token output differ from the argmax of its own logits? (LOAD side)

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=load EMBER_ARM=manual python3 benchmarks/diag_load_order.py STORE [key]

For one key (default 136) of a LOADed llama3-8b archive: which rows are wrong; does it depend on
the graph replayed before it (cross-graph memory); does zeroing or poisoning one window
allocation (memory SAVE's process initialised outside the graphs) change it.
"""

from __future__ import annotations

import json
import sys

import torch
from cuda.bindings import driver as cu

from ember.runtime.commands import make_workload, parse_sizes
from ember.runtime.driver import check
from ember.runtime.load import run_load
from ember.runtime.save import identity_for


def main() -> None:
    store = sys.argv[1]
    key = (int(sys.argv[2]) if len(sys.argv) > 2 else 136,)
    ident = identity_for(make_workload("llama3-8b", 0, parse_sizes("all"))).hash()
    loaded = run_load(store, ident, log=lambda m: print(m, file=sys.stderr))
    lib, w = loaded.library, loaded.workload
    outs = loaded.outputs

    def rows_wrong(k: tuple[int, ...]) -> list[int]:
        torch.cuda.synchronize()
        bad = (outs[k][1] != outs[k][0].argmax(-1)).nonzero().flatten().tolist()
        return bad

    def run(*keys: tuple[int, ...]) -> list[int]:
        w.reset_state(7)
        for k in keys:
            lib.launch(lib.key_index(k))
        return rows_wrong(keys[-1])

    res: dict[str, object] = {"key": key[0]}
    res["alone"] = run(key)[:40]
    for prev in (1, 8, 128, 144, 512):
        if (prev,) in lib._index:
            res[f"after_{prev}"] = len(run((prev,), key))
    log = (loaded.archive.alloc_log or b"").decode(errors="replace").split()
    allocs = []
    for j, word in enumerate(log):
        kinds = ("alloc", "async", "pool", "pitch")
        if word == "E" and j + 8 < len(log) and log[j + 3] == "window" and log[j + 2] in kinds:
            allocs.append((int(log[j + 4], 16), int(log[j + 5], 16), log[j + 8]))
    res["window_allocs"] = len(allocs)
    base = len(run(key))
    fixes = []
    for fill in (0x00, 0xFF):
        for a, n, caller in allocs:
            keep = torch.empty(n, dtype=torch.uint8, device="cuda")
            if cu.cuMemcpyDtoD(keep.data_ptr(), a, n)[0] != 0:
                continue  # freed since: not mapped here
            check(cu.cuMemsetD8(a, fill, n), "fill")
            got = len(run(key))
            check(cu.cuMemcpyDtoD(a, keep.data_ptr(), n), "restore")
            torch.cuda.synchronize()
            if got != base:
                fixes.append({"fill": fill, "addr": hex(a), "size": n, "caller": caller, "rows_wrong": got})
    res["rows_wrong_base"] = base
    res["fills_that_change_it"] = fixes[:20]
    g = lib.source.graph(lib.key_index(key))
    tail = g.nodes[-12:]
    res["last_nodes"] = [
        {"type": int(nd.type), "grid": getattr(nd.params, "grid", None), "kernel":
         loaded.library.source.kernels[nd.params.kernel].name[:90] if int(nd.type) == 0 else None}
        for nd in tail
    ]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
