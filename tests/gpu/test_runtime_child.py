"""Child process for the cross-process GPU tests (run as a script, never collected as tests).

    python tests/gpu/test_runtime_child.py '<json args>'

Runs under libember in load mode: optionally injects an allocation after arming (a divergence),
tries LOAD, and on a refusal captures natively (the fallback an engine takes). Prints one JSON
line: refused reason (if any), the path taken, and the greedy decode token hash.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    import torch

    from ember.engines.decode.adapter import load_workload
    from ember.engines.decode.workloads import make_workload, parse_sizes
    from ember.runtime.adapter import Refused
    from ember.runtime.proof.replay import decode_tokens
    from ember.runtime.session import native_session

    ip = native_session("load", perturb_first=args.get("perturb", True))
    keep = []
    if args.get("inject_divergence"):
        keep.append(torch.empty(8 << 20, dtype=torch.uint8, device="cuda"))  # SAVE made no such allocation
    out: dict = {}
    try:
        loaded = load_workload(args["store"], args["identity"], interposer=ip, log=lambda m: None)
        out["path"] = "restored"
        tm = loaded.timings
        # templates built on the background thread while the model built, not redone after
        out["background"] = "join_ms" in tm and "foreground_ms" not in tm and "background_error" not in tm
        out["tokens_sha256"] = decode_tokens(loaded.workload, loaded.launch, args["batch"])[0]
        out["saved_sha256"] = loaded.archive.engine["decode_sha256"].get(str(args["batch"]))
    except Refused as exc:
        out["refused"] = exc.reason
        out["path"] = "native"
        w = make_workload(args["workload"], args["layers"], parse_sizes(args["sizes"]))
        w.build()
        w.capture()
        out["tokens_sha256"] = decode_tokens(w, lambda k: w.graphs[k].replay(), args["batch"])[0]
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
