"""Diagnose restored outputs that differ from SAVE's: which way of launching a restored graph
gives SAVE's outputs (run like `ember load`: under libember in load mode, after `ember save`).

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=load python3 benchmarks/results/diag/diag_load_outputs.py STORE_URI [workload]

For every key, from one reset state, in SAVE's order: (a) the group template updated to the key
(what LOAD serves), (b) a dedicated exec of the key's graph, (c) the key's graph rebuilt by the
Python path and instantiated. Each is compared with SAVE's fingerprint, and its argmax output
with the argmax of its own logits (a wrong token with right logits = a race or a lost node).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ember.engines.decode.adapter import identity_for, load_workload
from ember.engines.decode.model import fingerprint
from ember.engines.decode.workloads import make_workload, parse_sizes
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.driver import check, torch_stream_handle


# long: one diagnostic run, read top to bottom: the launch ways share the loaded library,
# the saved fingerprints and one reset state
def main() -> None:
    from cuda.bindings import driver as cu

    store = sys.argv[1]
    workload = sys.argv[2] if len(sys.argv) > 2 else "llama3-8b"
    ident = identity_for(make_workload(workload, 0, parse_sizes("all"))).hash()
    loaded = load_workload(store, ident, log=lambda m: print(m, file=sys.stderr))
    lib, w = loaded.library, loaded.workload
    want = loaded.archive.engine.get("fingerprints", {})
    keys = [tuple(k) for k in lib.keys]
    stream = torch_stream_handle(None)

    def run(launch_one) -> dict[str, dict[str, bool]]:
        w.reset_state(7)
        out = {}
        for i, key in enumerate(keys):
            launch_one(i)
            torch.cuda.synchronize()
            outs = loaded.outputs[key]
            name = ",".join(map(str, key))
            first = bool(torch.equal(outs[1], outs[0].argmax(-1))) if len(outs) > 1 else None
            saved = fingerprint(outs) == want.get(name)
            out[name] = {
                "saved": saved,
                "argmax_before_fingerprint": first,
                "argmax": bool(torch.equal(outs[1], outs[0].argmax(-1))) if len(outs) > 1 else None,
            }
        return out

    def dedicated(i: int) -> None:
        check(cu.cuGraphLaunch(lib.own.instantiate(i), stream), "launch")

    python_execs: dict[int, object] = {}

    def python_built(i: int) -> None:
        ex = python_execs.get(i)
        if ex is None:
            g = rebuild.build(lib.prepared(i), lib.ctx, lib.events)
            ex = python_execs[i] = rebuild.instantiate(g)
        check(cu.cuGraphLaunch(ex, stream), "launch")

    res = {
        "template": run(lambda i: lib.launch(i)),
        "template_again": run(lambda i: lib.launch(i)),
        "dedicated": run(dedicated),
        "python": run(python_built),
    }
    summary: dict[str, Any] = {
        way: {
            "saved": sum(v["saved"] for v in r.values()),
            "argmax_ok": sum(bool(v["argmax"]) for v in r.values()),
            "argmax_ok_before_fingerprint": sum(bool(v["argmax_before_fingerprint"]) for v in r.values()),
            "differ": [k for k, v in r.items() if not v["saved"]][:12],
            "argmax_wrong": [k for k, v in r.items() if v["argmax"] is False][:12],
        }
        for way, r in res.items()
    }
    # Which allocations (SAVE's window, this process's later ones) cover the outputs that differ?
    from ember.native import Interposer

    log = Interposer.attach().export_alloc_log().decode().splitlines()
    events = []
    for line in log:
        f = line.split()
        if f and f[0] == "E":
            events.append((int(f[1], 16), f[2], f[3], int(f[4], 16), int(f[5], 16), f[8]))
    cover = {}
    for k in summary["template"]["differ"][:3]:
        for j, t in enumerate(loaded.outputs[tuple(int(x) for x in k.split(","))]):
            a = t.data_ptr()
            hits = [e for e in events if e[3] <= a < e[3] + max(e[4], 1)]
            starts = {e[3] for e in hits}
            hits += [e for e in events if e[3] in starts and e not in hits]  # their frees
            cover[f"{k}[{j}] {hex(a)}"] = [
                f"{seq} {kind} {phase} {hex(ad)}+{sz:#x} {c}" for seq, kind, phase, ad, sz, c in sorted(hits)
            ]
    summary["covering_events"] = cover
    name = lambda k: ",".join(map(str, k))  # noqa: E731
    summary["groups"] = {name(keys[g.template]): [name(keys[m]) for m in g.members] for g in lib.groups}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
