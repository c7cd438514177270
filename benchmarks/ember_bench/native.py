"""`ember bench native`: what libember costs on a GPU (run on a GPU machine).

Three measurements, each in fresh worker processes (this module is also the worker:
`python -m ember_bench.native --worker ROLE OUT.json`):
- eager forward of a Llama-3-8B-shaped model (a few layers, random weights), median ms per step,
  without the library, with it preloaded in pass-through (mode off) and in SAVE mode (goal: 1%);
- allocating an 8B model's weights plus a large KV cache through the fixed region (SAVE) vs the
  driver's own allocator (goal: within 1.2x);
- region set-up at LOAD: reserve + map the final extent + replay the capture window, in ms/GiB.
Writes benchmarks/results/native-<device>.json and .md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import native

H, NH, KV, INTER, VOCAB = 4096, 32, 8, 14336, 128256
GIB = 1 << 30
RESULTS = Path("benchmarks/results")
CONFIGS: tuple[tuple[str, dict[str, str]], ...] = (
    ("native", {}), ("pass-through", {"EMBER_MODE": "off"}), ("save", {"EMBER_MODE": "save"}),
)


# ---------------------------------------------------------------- workers (run on the GPU)

def _weight_shapes(layers: int) -> list[tuple[int, int]]:
    hd = H // NH
    per = [((NH + 2 * KV) * hd, H), (H, NH * hd), (2 * INTER, H), (H, INTER), (H, 1), (H, 1)]
    return [(VOCAB, H)] + per * layers + [(H, 1), (VOCAB, H)]


def _forward(res: dict[str, Any], layers: int, iters: int) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dt = torch.bfloat16
    ws = [torch.randn(*s, device="cuda", dtype=dt) * 0.02 for s in _weight_shapes(layers)]
    emb, head = ws[0], ws[-1]
    B, L = 32, 1024
    hd = H // NH
    kc = torch.zeros(layers, B, KV, L, hd, device="cuda", dtype=dt)
    vc = torch.zeros_like(kc)
    ids = torch.randint(0, VOCAB, (B,), device="cuda")

    def step() -> Any:
        x = emb[ids]
        for i in range(layers):
            wqkv, wo, wgu, wd, n1, n2 = ws[1 + 6 * i: 7 + 6 * i]
            h = F.rms_norm(x, (H,), n1.view(-1))
            q, k, v = (h @ wqkv.T).split([NH * hd, KV * hd, KV * hd], -1)
            kc[i][:, :, 7] = k.view(B, KV, hd)
            vc[i][:, :, 7] = v.view(B, KV, hd)
            a = F.scaled_dot_product_attention(q.view(B, NH, 1, hd), kc[i], vc[i], enable_gqa=True)
            x = x + a.reshape(B, -1) @ wo.T
            g, u = (F.rms_norm(x, (H,), n2.view(-1)) @ wgu.T).chunk(2, -1)
            x = x + (F.silu(g) * u) @ wd.T
        return (F.rms_norm(x, (H,), ws[-2].view(-1)) @ head.T).argmax(-1)

    with torch.inference_mode():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    res.update(median_ms=statistics.median(times), min_ms=min(times), iters=iters, batch=B, layers=layers)


def _interposer() -> Any:
    return native.Interposer.attach() if os.environ.get("EMBER_MODE") else None


def _alloc_sequence(kv_gib: float) -> tuple[list[Any], float]:
    """An 8B model's weights (32 layers, bf16) then one KV-cache tensor; returns (tensors, s)."""
    import torch

    t = time.perf_counter()
    ts = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in _weight_shapes(32)]
    ts.append(torch.empty(int(kv_gib * GIB), device="cuda", dtype=torch.uint8))
    torch.cuda.synchronize()
    return ts, time.perf_counter() - t


def _alloc(res: dict[str, Any], kv_gib: float) -> None:
    import torch

    torch.cuda.synchronize()
    ip = _interposer()
    if ip is not None:
        ip.arm()
    ts, secs = _alloc_sequence(kv_gib)
    res.update(seconds=secs, bytes=sum(x.numel() * x.element_size() for x in ts), tensors=len(ts))
    if ip is not None:
        res["stats"] = ip.stats()


def _window_allocs() -> list[Any]:
    import torch

    return [torch.empty(n << 20, device="cuda", dtype=torch.uint8) for n in (2, 34, 2, 66, 130, 2, 10) * 4]


def _load_setup(res: dict[str, Any], kv_gib: float, log_path: str, load: bool) -> None:
    import torch

    torch.cuda.synchronize()
    ip = _interposer()
    t = time.perf_counter()
    ip.arm()
    res["arm_s"] = time.perf_counter() - t
    if load:
        t = time.perf_counter()
        ip.import_alloc_log(Path(log_path).read_bytes())  # maps the final extent in one piece
        res["import_premap_s"] = time.perf_counter() - t
    keep, secs = _alloc_sequence(kv_gib)
    res["pre_window_alloc_s"] = secs
    if load:
        t = time.perf_counter()
        ip.replay_window()
        res["replay_s"] = time.perf_counter() - t
    else:
        ip.capture_begin()
        keep += _window_allocs()
        torch.cuda.synchronize()
        ip.capture_end()
        Path(log_path).write_bytes(ip.export_alloc_log())
    res["stats"] = ip.stats()
    res["divergence"] = ip.divergence()


# ---------------------------------------------------------------- driver side

def _run(role: str, out_dir: Path, env: dict[str, str], args: list[str]) -> dict[str, Any]:
    out = out_dir / f".bench-native-{role}-{len(list(out_dir.glob('.bench-native-*')))}.json"
    lib = os.environ.get("EMBER_LIB") or str(native.find_library() or "")
    e = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_") and k != "LD_PRELOAD"}
    mode = env.pop("EMBER_MODE", None)
    if mode is not None:
        if not lib:
            raise typer.BadParameter("libember.so not found: build it or set EMBER_LIB")
        e.update(LD_PRELOAD=lib, EMBER_LIB=lib, EMBER_MODE=mode, EMBER_ARM="manual")
    e.update(env)
    proc = subprocess.run([sys.executable, "-m", "ember_bench.native", "--worker", role, str(out), *args],
                          env=e, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {role} ({mode}) failed:\n{proc.stderr[-4000:]}")
    res = json.loads(out.read_text())
    out.unlink()
    return res


def bench_native(
    out_dir: Annotated[Path, typer.Option(help="Where native-<device>.{json,md} go.")] = RESULTS,
    layers: Annotated[int, typer.Option(help="Decoder layers of the eager-forward model.")] = 4,
    iters: Annotated[int, typer.Option(help="Timed forward steps per run.")] = 50,
    repeats: Annotated[int, typer.Option(help="Runs per configuration (median of medians).")] = 3,
    kv_gib: Annotated[float, typer.Option(help="KV cache size; 0 = 40% of the GPU's memory.")] = 0,
) -> None:
    """Measure libember's overheads (forward, allocation, LOAD set-up) and write the results."""
    import torch

    if not torch.cuda.is_available():
        raise typer.BadParameter("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    total = torch.cuda.get_device_properties(0).total_memory
    kv = kv_gib or round(0.4 * total / GIB)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": device, "torch": torch.__version__, "layers": layers, "kv_gib": kv}

    fwd: dict[str, list[float]] = {"native": [], "pass-through": [], "save": []}
    for _ in range(repeats):  # interleaved, so drift hits every configuration alike
        for name, env in CONFIGS:
            r = _run("forward", out_dir, dict(env), [str(layers), str(iters)])
            fwd[name].append(r["median_ms"])
    base = statistics.median(fwd["native"])
    res["forward_ms"] = {k: statistics.median(v) for k, v in fwd.items()}
    res["forward_overhead_pct"] = {k: 100 * (statistics.median(v) / base - 1) for k, v in fwd.items()}

    alloc: dict[str, list[float]] = {"native": [], "region": []}
    for _ in range(2):
        alloc["native"].append(_run("alloc", out_dir, {}, [str(kv)])["seconds"])
        r = _run("alloc", out_dir, {"EMBER_MODE": "save"}, [str(kv)])
        alloc["region"].append(r["seconds"])
    res["alloc_seconds"] = {k: min(v) for k, v in alloc.items()}
    res["alloc_ratio"] = res["alloc_seconds"]["region"] / res["alloc_seconds"]["native"]
    res["alloc_gib"] = round(r["bytes"] / GIB, 2)

    log = out_dir / ".bench-native-alloc.log"
    _run("load-setup", out_dir, {"EMBER_MODE": "save"}, [str(kv), str(log), "save"])
    ld = _run("load-setup", out_dir, {"EMBER_MODE": "load"}, [str(kv), str(log), "load"])
    log.unlink(missing_ok=True)
    mapped_gib = ld["stats"]["bytes_mapped"] / GIB
    setup_s = ld["arm_s"] + ld["import_premap_s"] + ld["replay_s"]
    res["load_setup"] = {"arm_ms": 1e3 * ld["arm_s"], "premap_ms": 1e3 * ld["import_premap_s"],
                         "replay_ms": 1e3 * ld["replay_s"], "mapped_gib": round(mapped_gib, 2),
                         "ms_per_gib": 1e3 * setup_s / max(mapped_gib, 1e-9),
                         "pre_window_alloc_ms": 1e3 * ld["pre_window_alloc_s"],
                         "divergence": ld["divergence"]}

    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    (out_dir / f"native-{slug}.json").write_text(json.dumps(res, indent=2))
    (out_dir / f"native-{slug}.md").write_text(_markdown(res))
    typer.echo(_markdown(res))


def _markdown(r: dict[str, Any]) -> str:
    f, o, ls = r["forward_ms"], r["forward_overhead_pct"], r["load_setup"]
    return "\n".join([
        f"# libember overheads on {r['device']} (torch {r['torch']})",
        "",
        f"Eager forward, Llama-3-8B-shaped, {r['layers']} layers, batch 32 decode step (median ms):",
        "",
        "| configuration | ms | vs native | goal |",
        "|---|---|---|---|",
        *[f"| {k} | {f[k]:.3f} | {o[k]:+.2f}% | within 1% |" for k in f],
        "",
        f"Allocating 8B weights + a {r['kv_gib']} GiB KV cache ({r['alloc_gib']} GiB):",
        "",
        "| allocator | seconds |",
        "|---|---|",
        f"| driver (cudaMalloc) | {r['alloc_seconds']['native']:.3f} |",
        f"| ember region | {r['alloc_seconds']['region']:.3f} |",
        f"| ratio | {r['alloc_ratio']:.2f}x (goal: within 1.2x) |",
        "",
        f"Region set-up at LOAD ({ls['mapped_gib']} GiB final extent): reserve {ls['arm_ms']:.2f} ms, "
        f"map {ls['premap_ms']:.2f} ms, replay {ls['replay_ms']:.2f} ms = **{ls['ms_per_gib']:.2f} ms/GiB**; "
        f"divergence: {ls['divergence']}.",
        "",
    ])


def _worker(argv: list[str]) -> None:
    role, out, *args = argv
    res: dict[str, Any] = {"role": role}
    if role == "forward":
        ip = _interposer()
        if ip is not None and ip.mode != "off":
            import torch

            torch.cuda.synchronize()
            ip.arm()
        _forward(res, int(args[0]), int(args[1]))
    elif role == "alloc":
        _alloc(res, float(args[0]))
    elif role == "load-setup":
        _load_setup(res, float(args[0]), args[1], load=args[2] == "load")
    Path(out).write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        typer.run(bench_native)
