"""Where do the first key's image loads go: is cuLibraryLoadData size-bound, do loaders scale?

    python benchmarks/results/diag/diag_image_loads.py STORE --threads 1,4,16,4e --out DIR   (4e: EAGER loading)

For the one archive in STORE (e.g. the store `ember bench graphs --store` saved into), per loader
thread count, one fresh process under libember in load mode (EMBER_LOADER_THREADS=n): every image
blob read first (not timed), then, timed from the first preload call, exactly what LOAD does on
its way to the first key: the first needed key's images preloaded, that graph's kernels resolved
(each waits for its own image; resolving loads the function into the context), then the other
images preloaded and every kernel of the archive resolved. Kept per run: each image's bytes,
load start and load time, the hand-off time, the waits, the per-kernel resolution times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def child(store: str) -> dict[str, Any]:
    from ember.archive import bundle
    from ember.archive import graph_table as fmt
    from ember.runtime import publish
    from ember.runtime.graphs.need import need_order
    from ember.runtime.session import native_session

    ip = native_session("load")
    assert ip is not None, "run under libember (EMBER_MODE=load)"
    arc = bundle.open_archive(store)
    table = fmt.decode(arc.blob_bytes(arc.manifest.graphs.table))
    order = publish.image_order(arc.manifest)
    options = arc.manifest.engine.get("image_options", {})
    data = {h: arc.kernel_image(h) for h in order}
    first_kernels = sorted(set(table.chunk(need_order(table.keys)[0]).kpar["kernel"].tolist()))
    wanted = {table.kernels[k].image for k in first_kernels}
    head = [h for h in order if h in wanted]
    kinds = {k.content_hash: (k.kind, k.kernels) for k in arc.manifest.kernel_images}
    out: dict[str, Any] = {
        # per image, in load order: [bytes, kind, kernels of the archive in it, load options]
        "images_detail": [[len(data[h]), *kinds.get(h, ("?", 0)), options.get(h, {})] for h in order],
        "images": len(order), "images_first": len(head), "kernels_first": len(first_kernels),
        "bytes_first": sum(len(data[h]) for h in head), "bytes_all": sum(len(d) for d in data.values()),
    }

    def resolve(kernels: list[int]) -> list[float]:
        ms = []
        for k in kernels:
            t = time.perf_counter()
            ip.function(table.kernels[k].image, table.kernels[k].name)
            ms.append((time.perf_counter() - t) * 1e3)
        return ms

    t0 = time.perf_counter()
    ip.preload([(h, data[h], options.get(h, {})) for h in head])
    out["handoff_first_ms"] = (time.perf_counter() - t0) * 1e3
    out["resolve_first_ms"] = resolve(first_kernels)
    out["first_ready_ms"] = (time.perf_counter() - t0) * 1e3
    rest = [h for h in order if h not in wanted]
    t = time.perf_counter()
    ip.preload([(h, data[h], options.get(h, {})) for h in rest])
    out["handoff_rest_ms"] = (time.perf_counter() - t) * 1e3
    others = [k for k in range(len(table.kernels)) if k not in set(first_kernels)]
    out["resolve_rest_ms"] = resolve(others)
    out["all_ready_ms"] = (time.perf_counter() - t0) * 1e3
    out["catalog"] = ip.stats()["catalog"]
    return out


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """MB/s of the loads and how load time follows size (least squares: ms = a + b * MB)."""
    loads = r["catalog"]["preloads"]
    mb = [size / 2**20 for size, _, _ in loads]
    ms = [t for _, _, t in loads]
    s: dict[str, Any] = {"load_ms_sum": sum(ms), "load_mb_sum": sum(mb)}
    if len(loads) > 2 and statistics.pvariance(mb) > 0:
        slope, intercept = statistics.linear_regression(mb, ms)
        s.update(ms_per_mb=slope, ms_fixed=intercept, r=statistics.correlation(mb, ms))
    s["first_wait_ms"] = sum(r["resolve_first_ms"])
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tag", default="gpu", help="the GPU, for the file name")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.store)))
        return
    from ember.runtime.session import preload_env

    runs = {}
    # "4" runs with 4 loader threads; "4e" the same with CUDA_MODULE_LOADING=EAGER
    for run in a.threads.split(","):
        n = int(run.rstrip("e"))
        env = {**preload_env("load"), "EMBER_LOADER_THREADS": str(n)}
        if run.endswith("e"):
            env["CUDA_MODULE_LOADING"] = "EAGER"
        p = subprocess.run([sys.executable, __file__, a.store, "--child"], env=env, capture_output=True,
                           text=True, timeout=300)
        if p.returncode != 0:
            runs[run] = {"error": p.stderr[-2000:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["summary"] = summarize(r)
        runs[run] = r
        print(run, {k: v for k, v in r.items() if not isinstance(v, list | dict)}, r["summary"], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"diag-image-loads-{a.tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
