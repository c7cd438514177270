"""`ember bench graphs --tp N / --ep N / --dp N`: a native N-rank capture against ONE single-GPU
SAVE → N-rank LOAD, same run.

1. native - N processes, one GPU each (CUDA_VISIBLE_DEVICES=r), torch.distributed on NCCL: build
            the rank's shard, warm up + capture every size (timed), greedy decode tokens at
            B = 1, 8, 64 and every graph's output fingerprint;
2. save   - ONE `ember save --tp/--ep/--dp` on GPU 0 under libember + libember_nccl (rank 0
            of the world, collectives as placeholders), published once;
3. load   - N fresh processes under libember, perturbed first: each creates its communicator,
            LOADs the same archive (its collectives spliced in), decodes and fingerprints.
Per rank: tokens and outputs identical to the native rank's, LOAD time and what the splice took,
native capture time, the ratio; archive bytes; any refusal. `--collectives` with a world of one
runs the same path on one GPU (a real one-rank communicator: the splice check of one GPU).
The report goes to benchmarks/results/parallel-<shape>-<device>-<stamp>.{json,md}.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DECODE_BATCHES = (1, 8, 64)


def _shape(args: dict[str, Any], rank: int) -> Any:
    from ember.engines.decode.workloads import parallel_shape

    return parallel_shape(args["tp"], args["ep"], args["dp"], args["collectives"], rank)


def _measure(w: Any, launch: Any, keys: list[tuple[int, ...]], outputs: Any) -> dict[str, Any]:
    from ember.runtime.proof.replay import decode_trace, replay_fingerprints

    batches = [b for b in DECODE_BATCHES if (b,) in keys]
    traces = {str(b): decode_trace(w, launch, b) for b in batches}
    return {
        "decode_sha256": {b: t["sha256"] for b, t in traces.items()},
        "fingerprints": replay_fingerprints(w, launch, keys, outputs),
    }


def role_native(args: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.decode.parallel import init_process_group
    from ember.engines.decode.workloads import make_workload, parse_sizes
    from ember.runtime.session import ensure_context
    from ember_bench.graphs import build_and_capture

    ensure_context()
    par = _shape(args, int(os.environ.get("RANK", "0")))
    init_process_group(par, stub=False)
    w = make_workload(args["workload"], args["layers"], parse_sizes(args["sizes"]), parallel=par)
    out = build_and_capture(w)
    keys: list[tuple[int, ...]] = [(b,) for b in w.sizes]
    out.update(_measure(w, lambda k: w.graphs[k].replay(), keys, lambda k: list(w.outs[k])))
    return out


def role_load(args: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.decode.adapter import load_workload
    from ember.runtime.adapter import Refused

    par = _shape(args, int(os.environ.get("RANK", "0")))
    try:
        loaded = load_workload(
            args["store"], args["identity"], perturb_first=True, log=lambda m: None, parallel=par
        )
    except Refused as exc:
        return {"refused": f"{exc.stage}: {exc.reason}"}
    lt = loaded.timings
    out: dict[str, Any] = {
        "timings": lt,
        "load_ms": lt["load_ms"],
        "load_first_ms": lt.get("load_first_ms", 0.0),
        "splice_ms": lt.get("splice_ms", 0.0),
        "collective_capture_ms": lt.get("collective_capture_ms", 0.0),
        "collectives": lt.get("collectives", 0),
        "templates": len(loaded.library.groups),
    }
    keys = [tuple(k) for k in loaded.library.keys]
    out.update(_measure(loaded.workload, loaded.launch, keys, lambda k: loaded.outputs[k]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    role: str, args: dict[str, Any], env: dict[str, str], world: int, timeout: float
) -> list[dict[str, Any]]:
    """One child per rank, all at once (they rendezvous); each writes its JSON, then exits. Rank r
    runs on the r-th GPU that `env`'s CUDA_VISIBLE_DEVICES lists (all of them if unset)."""
    port, procs, outs = _free_port(), [], []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(r) for r in range(world)]
    for r in range(world):
        fd, out = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        e = {
            **env,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        if world > 1:
            e["CUDA_VISIBLE_DEVICES"] = devices[r]
        cmd = [sys.executable, "-m", "ember_bench.parallel", role, json.dumps({**args, "out": out})]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    results = []
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        sys.stderr.write(f"--- {role} rank {r} ---\n{err[-3000:]}")
        if p.returncode != 0:
            results.append({"error": f"{role} rank {r} exited {p.returncode}", "stderr": err[-2000:]})
        else:
            results.append(json.loads(Path(out).read_text()))
    return results


def save_shape(args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """ONE `ember save` of the shape, on the first GPU (the stub plays rank 0 of the world)."""
    from ember_bench.graphs import run_save

    argv = [f"--{k}={args[k]}" for k in ("workload", "layers", "sizes", "store", "tp", "ep", "dp")]
    argv += ["--collectives"] if args["collectives"] else []
    first_gpu = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return run_save(argv, {**env, "CUDA_VISIBLE_DEVICES": first_gpu}, timeout)


def bench_parallel(
    workload: str,
    layers: int,
    sizes: str,
    store: str,
    tp: int,
    ep: int,
    dp: int,
    collectives: bool,
    timeout: float = 900,
) -> dict[str, Any]:
    """Native N ranks, one SAVE, N-rank LOAD; per-rank verdicts."""
    import torch

    args = {
        "workload": workload,
        "layers": layers,
        "sizes": sizes,
        "tp": tp,
        "ep": ep,
        "dp": dp,
        "collectives": collectives,
        "store": store,
    }
    world = _shape(args, 0).world
    if torch.cuda.device_count() < world:
        return {
            "workload": workload,
            "error": f"a world of {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}",
        }
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
    base.setdefault("NCCL_NVLS_ENABLE", "0")  # the GPU machines' rule: no NVLink multicast
    res: dict[str, Any] = {
        "workload": workload,
        "layers": layers or "model",
        "shape": _shape(args, 0).degrees(),
        "world": world,
    }
    native = run_ranks("native", args, base, world, timeout)
    res["device"] = native[0].get("device")
    from ember.runtime.session import preload_env

    saved = save_shape(args, base, timeout)
    if "error" in saved:
        return {**res, "native": native, "save_error": saved}
    res.update(
        archive_bytes=saved["bytes"],
        graphs=saved["graphs"],
        identity=saved["identity"],
        save_s=saved["durations"].get("total_s"),
        save_capture_s=saved["durations"].get("capture_s"),
    )
    loaded = run_ranks(
        "load", {**args, "identity": saved["identity"]}, preload_env("load", base), world, timeout
    )
    res["ranks"] = [rank_verdict(r, n, lo) for r, (n, lo) in enumerate(zip(native, loaded, strict=True))]
    return res


def rank_verdict(rank: int, native: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank}
    for what, r in (("native", native), ("load", loaded)):
        if "error" in r or "refused" in r:
            out[f"{what}_error"] = r.get("error") or f"refused: {r['refused']}"
            out["stderr"] = r.get("stderr", "")[-800:]
    if len(out) > 1:
        return out
    nf, lf = native["fingerprints"], loaded["fingerprints"]
    out.update(
        native_capture_s=native["native_capture_s"],
        load_ms=loaded["load_ms"],
        load_first_ms=loaded.get("load_first_ms", 0.0),
        splice_ms=loaded["splice_ms"],
        collective_capture_ms=loaded["collective_capture_ms"],
        collectives=loaded["collectives"],
        native_over_load=native["native_capture_s"] * 1e3 / loaded["load_ms"],
        verify_ms=loaded["timings"].get("verify_ms"),
        verify=loaded["timings"].get("verify"),
        verify_parts_ms=loaded["timings"].get("verify_parts"),
        templates=loaded["templates"],
        tokens_identical={
            b: native["decode_sha256"].get(b) == sha for b, sha in loaded["decode_sha256"].items()
        },
        outputs_identical=sum(nf.get(k) == v for k, v in lf.items()),
        outputs=len(lf),
    )
    return out


def markdown(report: dict[str, Any]) -> str:
    r = report["result"]
    lines = [
        f"# Multi-GPU graphs: one single-GPU SAVE, {r.get('world')}-rank LOAD",
        "",
        f"- device: {report['device']}, date {report['date']}",
        f"- workload {r['workload']}, layers {r.get('layers')}, shape {r.get('shape')}",
        "",
    ]
    if "error" in r or "save_error" in r:
        return "\n".join([*lines, f"Did not run: {r.get('error') or r.get('save_error')}", ""])
    lines += [
        f"- archive {r['archive_bytes'] / 1e6:.1f} MB, {r['graphs']} graphs; SAVE {r['save_s']:.1f} s "
        f"(capture {r['save_capture_s']:.2f} s) on one GPU",
        "",
        "| rank | native capture s | LOAD ms (first) | splice ms | verify ms | native/LOAD "
        "| tokens identical | outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["ranks"]:
        if "load_ms" not in x:
            err = f"{x.get('native_error', '')} | {x.get('load_error', '')}"
            lines.append(f"| {x['rank']} | {err} | | | | | |")
            continue
        tok = ", ".join(f"B={b}: {'yes' if v else 'NO'}" for b, v in x["tokens_identical"].items())
        splice = f"{x['splice_ms']:.1f} ({x['collectives']}: capture {x['collective_capture_ms']:.1f})"
        lines.append(
            f"| {x['rank']} | {x['native_capture_s']:.2f} | {x['load_ms']:.1f} "
            f"({x.get('load_first_ms', 0):.1f}) | {splice} | {x.get('verify_ms', 0):.1f} | "
            f"{x['native_over_load']:.2f} | {tok} | {x['outputs_identical']}/{x['outputs']} |"
        )
    lines += [
        "",
        "LOAD ms: until every template is instantiated, minus the model build (templates build on a "
        "background thread while the model builds); (first): until the library is handed over with "
        "its first template. native/LOAD uses LOAD ms.",
        "splice ms (distinct collectives: their capture ms): this rank's collectives captured with its "
        "communicator and the templates regrouped (part of LOAD ms, on the background thread).",
        "verify ms: LOAD's canary on this rank (part of LOAD ms): the first key's graph replayed "
        "from the canary state and compared with SAVE's fingerprint, as instantiated, after an exec "
        "update and on its own exec.",
        "",
    ]
    return "\n".join(lines)


def run(out_dir: Path, **job: Any) -> dict[str, Any]:
    """bench_parallel(**job), its report written to `out_dir` (JSON + markdown)."""
    r = bench_parallel(**job)
    device = str(r.get("device") or "unknown")
    report = {"device": device, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "result": r}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    shape = f"tp{job['tp']}-ep{job['ep']}-dp{job['dp']}"
    stem = f"parallel-{job['workload']}-{shape}-{device.replace(' ', '_')}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text(markdown(report))
    return report


def _main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    out = role_native(args) if role == "native" else role_load(args)
    Path(args["out"]).write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    os._exit(0)  # NCCL teardown can hang (brief: cuda-interposition §10); the result is written


if __name__ == "__main__":
    _main()
