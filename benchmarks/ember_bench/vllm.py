"""`ember bench vllm`: vLLM 0.26 start-up, native vs SAVE → fresh-process LOAD (GPU machine).

Random weights (`load_format="dummy"`) of a real model shape, the HF config written locally (no
model hub), graph mode FULL_AND_PIECEWISE, vLLM's default capture sizes and Inductor's
deterministic mode (as a deployment's pods: `ember.engines.vllm.args.NUMERICS`). Each run is a fresh
process with the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); native, save and
native-warm share one compile cache (`VLLM_CACHE_ROOT` under the work directory), LOAD starts from
an empty one and gets the compiled code from the archive (its compile-cache attachment), as a
fresh pod does:

1. `native` — plain vLLM, cold compile cache (init + compile + memory profiling + capture);
2. `save` — libember preloaded (EMBER_MODE=save), `kv_cache_memory_bytes` from run 1, the ember
   plugin captures every key once inside libember's window, proves and publishes the archive;
3. `load` — libember preloaded (EMBER_MODE=load), empty compile cache: the archive's compile cache
   put back, the graphs restored instead of capturing;
4. `native-warm` — plain vLLM again with the compile cache warm (what vLLM's own cache gives).

Each run reports start → first token, engine init and its stages (the plugin times vLLM's worker
stages), time in graph capture, graphs captured while serving (vLLM's `compilation_counter`),
greedy tokens for several batch sizes (compared with run 1). Report:
`benchmarks/results/vllm-<device>-<model>.{json,md}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ember.engines.transformers_cb.engine import BUILTIN_SHAPES
from ember.engines.vllm.args import process_env
from ember.engines.vllm.compile_cache import TRITON_HOME
from ember_bench.vllm_report import write_report

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {  # ember serve's built-in shape, with what vLLM reads from a checkpoint's config
        **BUILTIN_SHAPES["llama-3-8b"],
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-moe": {  # Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}
RUNS = ("native", "save", "load", "native-warm")


def write_config(model: str, layers: int | None, path: Path) -> Path:
    cfg = dict(SHAPES[model])
    if layers:
        cfg["num_hidden_layers"] = layers
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def _child_env(mode: str, work: Path, report: Path, extra: dict[str, str]) -> dict[str, str]:
    env = process_env(mode, os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        VLLM_CACHE_ROOT=str(_cache_root(mode, work)),
        TRITON_HOME=str(_cache_root(mode, work) / TRITON_HOME),  # no run finds another's ~/.triton
        EMBER_VLLM_REPORT=str(report),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def _cache_root(mode: str, work: Path) -> Path:
    """vLLM's cache root of a run: LOAD starts from an empty one, like a fresh pod, and gets the
    compiled code from the archive's attachment; the other runs share one."""
    if mode != "load":
        return work / "vllm-cache"
    fresh = work / "vllm-cache-load"
    shutil.rmtree(fresh, ignore_errors=True)
    return fresh


def run_session(cmd: list[str], env: dict[str, str], logf: Path, timeout: float) -> int | str:
    """One engine process in a session of its own, its output in `logf`; its exit status, or
    "timeout". Every process of the session is killed when it ends: a vLLM worker stuck in a
    collective outlives its parent and would hold its GPU through the runs after."""
    with open(logf, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return rc


def run_child(
    mode: str, work: Path, args: dict[str, Any], extra: dict[str, str], timeout: float
) -> dict[str, Any]:
    """One fresh engine process; its JSON result (or the error and the log's tail)."""
    out, report, logf = work / f"{mode}.json", work / f"{mode}.report.json", work / f"{mode}.log"
    for stale in (out, report):
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ember_bench.vllm_child", json.dumps({**args, "out": str(out)})]
    t = time.perf_counter()
    rc = run_session(cmd, _child_env(mode, work, report, extra), logf, timeout)
    wall = time.perf_counter() - t
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    res.update(mode=mode, rc=rc, process_wall_s=round(wall, 3))
    if report.exists():
        res["ember"] = json.loads(report.read_text())
    if rc != 0 or not out.exists():
        res["log_tail"] = logf.read_text()[-6000:]
    typer.echo(f"{mode}: rc={rc} wall={wall:.1f}s first_token={res.get('first_token_s')}")
    return res


def archive_dir(save: dict[str, Any], store: Path) -> str:
    ident = ((save.get("ember") or {}).get("stages", {}).get("save") or {}).get("identity", "")
    return str(store / "archives" / ident) if ident else ""


# long: a typer command, its options are its signature
def bench_vllm(
    model: Annotated[str, typer.Option(help=f"One of {', '.join(SHAPES)}.")] = "llama-3-8b",
    layers: Annotated[int, typer.Option(help="Override the number of layers (0: the model's).")] = 0,
    work: Annotated[Path, typer.Option(help="Configs, compile cache, store, logs.")] = Path(
        "/tmp/ember-vllm"
    ),
    out_dir: Annotated[Path, typer.Option(help="Report folder.")] = Path("benchmarks/results"),
    batch_sizes: Annotated[str, typer.Option(help="Greedy generation batch sizes.")] = "1,4,16,64",
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request.")] = 16,
    runs: Annotated[str, typer.Option(help="Which runs, in order.")] = ",".join(RUNS),
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's memory fraction.")] = 0.85,
    timeout: Annotated[float, typer.Option(help="Seconds per run.")] = 420.0,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (N GPUs: native vs one-GPU SAVE → "
                                                 "N-rank LOAD).")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel ranks: tensor x data (alone: data = N, "
                                                 "attention data parallel).")] = 1,
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel ranks (MoE: with --ep).")] = 1,
    tp1_save: Annotated[bool, typer.Option(help="With --tp/--ep/--dp: also SAVE the same model at TP=1, "
                                                "the SAVE time the shape's is held to.")] = True,
    loads: Annotated[int, typer.Option(help="Fresh N-rank LOADs of the one archive, each compared with "
                                            "native (a race shows in some only); at TP=1 a pod's path, "
                                            "as --tp runs it, on one GPU.")] = 1,
    diagnose: Annotated[bool, typer.Option(help="With --tp/--ep/--dp: also plain vLLM on SAVE's compiled "
                                                "code and a LOAD without an archive (where tokens part "
                                                "from native's).")] = False,
    floor: Annotated[bool, typer.Option(help="Also native on native's warm cache and a pod's KV size; "
                                             "less its capture, the start no restore shortens (at TP=1 "
                                             "a pod's path, as --loads).")] = False,
    ab: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE[,KEY=VALUE] (repeatable): the LOADs cycle through none and each of these, and "
             "the summary gives each group's spreads (an A/B in one run).")] = None,
    pins_cost: Annotated[bool, typer.Option(help="Instead: one decode step (over --max-tokens steps) of "
                                                 "native vLLM as vLLM runs the shape and as a pod runs it, "
                                                 "with ember's pins (bench vllm_pins).")] = False,
) -> None:
    """vLLM start-up: native vs SAVE → fresh-process LOAD (report in benchmarks/results); with
    --tp/--ep/--dp: N-rank native vs one single-GPU SAVE → N-rank LOAD, per-rank figures (also at
    TP=1 with --loads N or --floor: a pod's path on one GPU, `vllm_parallel` at a world of one)."""
    ab = ab or []
    if ab and (loads < len(ab) + 1 or not all("=" in kv for one in ab for kv in one.split(","))):
        raise typer.BadParameter("--ab takes KEY=VALUE and needs a LOAD without and one with each")
    if tp > 1 or dp > 1 or ep > 1 or pins_cost or loads > 1 or floor:
        from ember_bench.vllm_parallel import bench_shape
        from ember_bench.vllm_pins import bench_pins_cost

        common = {"work": work, "out_dir": out_dir, "batch_sizes": [int(b) for b in batch_sizes.split(",")],
                  "gpu_memory_utilization": gpu_memory_utilization, "timeout": timeout}
        more = {"run": bench_pins_cost, "steps": max_tokens} if pins_cost else {
            "max_tokens": max_tokens, "tp1_save": tp1_save, "loads": loads, "diagnose": diagnose,
            "floor": floor, "ab": ab}
        bench_shape(model, layers, tp, ep, dp, **more, **common)
        return
    order = runs.split(",")
    if "save" in order and "native" not in order[: order.index("save")]:
        # SAVE takes native's KV-cache size; without it the plugin refuses and vLLM captures natively
        raise typer.BadParameter("--runs: save needs native before it (its KV-cache size)")
    work = work.absolute() / (model + (f"-{layers}l" if layers else ""))
    cfg = write_config(model, layers or None, work / "config")
    store = work / "store"
    args: dict[str, Any] = {
        "model": str(cfg),
        "batch_sizes": [int(b) for b in batch_sizes.split(",")],
        "max_tokens": max_tokens,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    results: dict[str, dict[str, Any]] = {}
    for mode in order:
        extra: dict[str, str] = {"EMBER_VLLM_MODEL": model + (f"-{layers}l" if layers else "")}
        child_args = dict(args)
        if mode == "save":
            kv = (results.get("native") or {}).get("kv_cache_memory_bytes")
            child_args["kv_cache_memory_bytes"] = kv
            extra["EMBER_VLLM_STORE"] = store.as_uri()
        if mode == "load":
            extra["EMBER_VLLM_ARCHIVE"] = archive_dir(results.get("save") or {}, store)
        results[mode] = run_child(mode, work, child_args, extra, timeout)
    write_report(model, layers, results, out_dir, store)
