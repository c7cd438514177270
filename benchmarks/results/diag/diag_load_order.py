"""Why does a restored graph's token output differ from the argmax of its own logits? (LOAD side)

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=load EMBER_ARM=manual \\
        python3 benchmarks/results/diag/diag_load_order.py STORE [key]

For one key (default 136) of a LOADed llama3-8b archive: which rows are wrong; does it depend on
the graph replayed before it (cross-graph memory); does zeroing or poisoning one window
allocation (memory SAVE's process initialised outside the graphs) change it.
"""

from __future__ import annotations

import json
import sys

import torch
from cuda.bindings import driver as cu

from ember.engines.decode.adapter import identity_for, load_workload
from ember.engines.decode.workloads import make_workload, parse_sizes
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.driver import check, torch_stream_handle


def ip_stats() -> dict:
    from ember.native import Interposer

    return Interposer.attach().stats()


# long: one diagnostic run, read top to bottom: each experiment replays from the same
# loaded library and reset state and adds its finding to one record
def main() -> None:
    store = sys.argv[1]
    key = (int(sys.argv[2]) if len(sys.argv) > 2 else 136,)
    ident = identity_for(make_workload("llama3-8b", 0, parse_sizes("all"))).hash()
    loaded = load_workload(store, ident, log=lambda m: print(m, file=sys.stderr))
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
    import os

    for fill in () if os.environ.get("DIAG_NO_FILL") else (0x00, 0xFF):
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
    # The ordered replay the proofs use: every key before `key` once, from one reset state.
    keys = [tuple(k) for k in lib.keys]
    before = keys[: keys.index(key)]
    w.reset_state(7)
    for k in before:
        lib.launch(lib.key_index(k))
    lib.launch(lib.key_index(key))
    bad = rows_wrong(key)
    logits, tok = outs[key][0].float(), outs[key][1]
    res["ordered_rows_wrong"] = bad[:40]
    res["ordered_detail"] = [
        {"row": r, "tok": int(tok[r]), "argmax": int(logits[r].argmax()),
         "logit_at_tok": float(logits[r, tok[r]]), "max": float(logits[r].max()),
         "nan": bool(logits[r].isnan().any()), "ties": int((logits[r] == logits[r].max()).sum())}
        for r in bad[:6]
    ]
    # The same, with every programmatic edge of `key`'s graph made a plain edge.
    i = lib.key_index(key)
    prep = lib.prepared(i)
    data = prep.edge_data
    res["programmatic_edges_in_graph"] = (
        int(sum(data[8 * e + 2] != 0 for e in range(len(prep.edge_src)))) if data else 0
    )
    if data:
        ed = bytes(data)
        last = int(prep.nodes) - 1
        res["edges_into_last_12_nodes"] = [
            (int(a), int(b), ed[8 * e], ed[8 * e + 1], ed[8 * e + 2])
            for e, (a, b) in enumerate(zip(prep.edge_src, prep.edge_dst, strict=True))
            if int(b) > last - 12
        ]
        prep.edge_data = None
        plain = rebuild.instantiate(rebuild.build(prep, lib.ctx, lib.events))
        prep.edge_data = data
        w.reset_state(7)
        for k in before:
            lib.launch(lib.key_index(k))
        check(cu.cuGraphLaunch(plain, torch_stream_handle(None)), "launch")
        res["ordered_rows_wrong_plain_edges"] = len(rows_wrong(key))
    # Does fingerprinting (large temporaries from torch's allocator) overwrite the outputs?
    from ember.engines.decode.model import fingerprint

    w.reset_state(7)
    for k in before:
        lib.launch(lib.key_index(k))
        torch.cuda.synchronize()
        fingerprint(outs[k])
    lib.launch(lib.key_index(key))
    res["fingerprinting_before_rows_wrong"] = len(rows_wrong(key))
    tok_before = outs[key][1].clone()
    fingerprint(outs[key])
    res["tok_changed_by_its_own_fingerprint"] = not torch.equal(tok_before, outs[key][1])
    res["rows_wrong_after_fingerprint"] = len(rows_wrong(key))
    probe = torch.empty(outs[key][0].numel() * 4, dtype=torch.uint8, device="cuda")
    res["addresses"] = {
        "logits": hex(outs[key][0].data_ptr()), "logits_bytes": outs[key][0].numel() * 2,
        "tok": hex(outs[key][1].data_ptr()), "new_alloc": hex(probe.data_ptr()), "new_bytes": probe.numel(),
    }
    res["ember_stats"] = {k: v for k, v in ip_stats().items() if not isinstance(v, (list, dict))}
    # Twice in a row at the end of the ordered replay: state-dependent or not?
    w.reset_state(7)
    for k in before:
        lib.launch(lib.key_index(k))
    lib.launch(i)
    lib.launch(i)
    res["ordered_then_again_rows_wrong"] = len(rows_wrong(key))
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
