"""Diagnose restored outputs that differ from SAVE's: which way of launching a restored graph
gives SAVE's outputs (run like `ember load`: under libember in load mode, after `ember save`).

    LD_PRELOAD=$EMBER_LIB EMBER_MODE=load python3 benchmarks/diag_load_outputs.py STORE_URI [workload]

For every key, from one reset state, in SAVE's order: (a) the group template updated to the key
(what LOAD serves), (b) a dedicated exec of the key's graph, (c) the key's graph rebuilt by the
Python path and instantiated. Each is compared with SAVE's fingerprint, and its argmax output
with the argmax of its own logits (a wrong token with right logits = a race or a lost node).
"""

from __future__ import annotations

import json
import sys

import torch

from ember.runtime import rebuild
from ember.runtime.commands import make_workload, parse_sizes
from ember.runtime.driver import check, torch_stream_handle
from ember.runtime.load import run_load
from ember.runtime.save import identity_for
from ember.runtime.workloads import fingerprint


def main() -> None:
    from cuda.bindings import driver as cu

    store = sys.argv[1]
    workload = sys.argv[2] if len(sys.argv) > 2 else "llama3-8b"
    ident = identity_for(make_workload(workload, 0, parse_sizes("all"))).hash()
    loaded = run_load(store, ident, log=lambda m: print(m, file=sys.stderr))
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
            out[name] = {
                "saved": fingerprint(outs) == want.get(name),
                "argmax": bool(torch.equal(outs[1], outs[0].argmax(-1))) if len(outs) > 1 else None,
            }
        return out

    def dedicated(i: int) -> None:
        check(cu.cuGraphLaunch(lib.dedicate(i), stream), "launch")

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
    summary = {
        way: {
            "saved": sum(v["saved"] for v in r.values()),
            "argmax_ok": sum(bool(v["argmax"]) for v in r.values()),
            "differ": [k for k, v in r.items() if not v["saved"]][:12],
            "argmax_wrong": [k for k, v in r.items() if v["argmax"] is False][:12],
        }
        for way, r in res.items()
    }
    name = lambda k: ",".join(map(str, k))  # noqa: E731
    summary["groups"] = {name(keys[g.template]): [name(keys[m]) for m in g.members] for g in lib.groups}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
