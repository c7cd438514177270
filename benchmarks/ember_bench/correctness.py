"""`ember bench correctness`: is a restore right on EVERY start? One command on a GPU machine.

Per case: the engine's own capture once (native), ONE SAVE, then `--starts` fresh LOAD processes
(default 10), each compared with native; a multi-GPU case LOADs every rank in each start.
Races show in some starts only, so the verdict is wrong starts / N, never one run.

- decode: every built-in decode workload, eager and compiled (`ember.engines.decode`), greedy
  tokens at B = 1, 8, 64 and every graph's outputs (`ember_bench.parallel`'s roles);
- parallel: TP=2, EP=2, DP=2, and TP=4, EP=4 where the machine has 4 GPUs: native N ranks, one
  single-GPU SAVE, N-rank LOADs; a start is wrong if any rank differs;
- cb: transformers' continuous-batching engine on decoder architectures of transformers 5.17,
  built from their own config classes with random weights and scaled down (`ARCHITECTURES`),
  the `ember bench cb` workload's tokens (all prompts of a wave queued at once, so batches do not
  depend on thread timing).
A start that refused the archive and captured natively is counted apart ("fell back"): it must
still serve native's tokens (CB); a decode LOAD that refuses has no tokens to compare.
Cases run in parallel lanes, one per GPU (a world of N takes N). A case that cannot run says why.
The report: benchmarks/results/correctness-<device>-<stamp>.{json,md}, written after each case.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

DECODE_WORKLOADS = ("llama3-8b", "qwen3-8b", "qwen3-moe", "gemma3")
PARALLEL = (("tp", "llama3-8b"), ("ep", "qwen3-moe"), ("dp", "llama3-8b"))
SIZES = "1,2,4,8,16,32,64"

SMALL_CONFIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
                "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32768,
                "max_position_embeddings": 4096}
_MOE = {"num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512}
# model_type → what it is, and the settings beyond SMALL_CONFIG that make it that (sliding window, MoE,
# multi-query, parallel attention, hybrid local/global layers)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("dense GQA", {}),
    "mistral": ("sliding window", {"sliding_window": 256}),
    "mistral-full-size": ("sliding window, 32 layers, hidden 4096 (the shape that failed)",
                          {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "sliding_window": 4096}),
    "mixtral": ("MoE + sliding window", {**_MOE, "sliding_window": 256}),
    "qwen2": ("dense, attention bias", {}),
    "qwen3": ("dense, QK norm", {"head_dim": 64}),
    "qwen2_moe": ("MoE with a shared expert", {**_MOE, "shared_expert_intermediate_size": 1024}),
    "qwen3_moe": ("MoE, QK norm", {**_MOE, "head_dim": 64}),
    "phi3": ("fused QKV", {}),
    "gemma": ("multi-query", {"num_key_value_heads": 1, "head_dim": 64}),
    "gemma2": ("hybrid local/global, soft-capping", {"sliding_window": 256, "head_dim": 64}),
    "gemma3_text": ("hybrid local/global (5:1)", {"sliding_window": 256, "head_dim": 64,
                                                  "num_hidden_layers": 6}),
    "starcoder2": ("sliding window, GELU MLP", {"sliding_window": 256}),
    "falcon": ("multi-query, parallel attention", {"multi_query": True, "parallel_attn": True,
                                                   "new_decoder_architecture": False, "num_kv_heads": 1}),
    "gpt_neox": ("parallel residual", {"use_parallel_residual": True}),
    "gptj": ("parallel attention + MLP", {"rotary_dim": 64}),
    "cohere": ("parallel block, logit scale", {}),
    "olmo2": ("post-norm, QK norm", {}),
    "granite": ("scaled residuals", {}),
    "stablelm": ("partial rotary", {}),
}


@dataclass
class Case:
    name: str
    kind: str  # "decode" | "parallel" | "cb"
    world: int
    args: dict[str, Any] = field(default_factory=dict)


def all_cases(gpus: int, layers: int = 0) -> list[Case]:
    """`layers`: the decode and parallel cases' depth (0: each workload's own)."""
    depth = {"layers": layers} if layers else {}
    cases = [Case(f"decode/{w}{c}", "decode", 1, {"workload": w + c, **depth}) for w in DECODE_WORKLOADS
             for c in ("", "-compile")]
    for n in (2, 4):
        for dim, w in PARALLEL:
            if n == 4 and dim == "dp":
                continue
            cases.append(Case(f"parallel/{dim}{n}-{w}", "parallel", n, {"workload": w, dim: n, **depth}))
    cases += [Case(f"cb/{a}", "cb", 1, {"arch": a}) for a in ARCHITECTURES]
    # the sliding-window shape whose restores once differed, its own execs swapped in at a chosen
    # launch (EMBER_SWAP_AT_LAUNCH) instead of wherever the background thread got to
    swap = [("mistral-full-size", k) for k in (8, 64)]
    cases += [Case(f"cb/{a}@swap-at-{k}", "cb", 1, {"arch": a, "load_env": {"EMBER_SWAP_AT_LAUNCH": str(k)}})
              for a, k in swap]
    return [c for c in cases if c.world <= max(gpus, 1)] + [
        Case(c.name, c.kind, c.world, {**c.args, "skip": f"needs {c.world} GPUs, this machine has {gpus}"})
        for c in cases if c.world > max(gpus, 1)
    ]


class Lanes:
    """The machine's GPUs, handed out per case (a world of N takes N at once)."""

    def __init__(self, ids: list[str]) -> None:
        self.free, self.cond = list(ids), threading.Condition()

    def take(self, n: int) -> list[str]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.free) >= n)
            got, self.free = self.free[:n], self.free[n:]
            return got

    def give(self, ids: list[str]) -> None:
        with self.cond:
            self.free += ids
            self.cond.notify_all()


# ---- one case --------------------------------------------------------------------------------
def _decode_case(
    case: Case, env: dict[str, str], starts: int, together: int, store: str, timeout: float
) -> dict[str, Any]:
    """Native ranks once, ONE SAVE, `starts` LOADs of every rank (ember_bench.parallel's roles)."""
    from ember.runtime.session import preload_env
    from ember_bench import parallel

    a = case.args
    args = {"workload": a["workload"], "layers": a.get("layers", 0), "sizes": a.get("sizes", SIZES),
            "tp": a.get("tp", 1), "ep": a.get("ep", 1), "dp": a.get("dp", 1), "collectives": False,
            "store": store}
    native = parallel.run_ranks("native", args, env, case.world, timeout)
    if any("error" in r for r in native):
        return {"error": "native: " + "; ".join(r.get("error", "") + " " + r.get("stderr", "")[-300:]
                                                for r in native if "error" in r)}
    saved = parallel.save_shape(args, env, timeout)
    if "error" in saved:
        return {"error": f"save: {saved['error']} {saved.get('stderr', '')[-600:]}"}

    def start(_: int) -> dict[str, Any]:
        loaded = parallel.run_ranks("load", {**args, "identity": saved["identity"]}, preload_env("load", env),
                                 case.world, timeout)
        return decode_start([parallel.rank_verdict(r, n, lo)
                              for r, (n, lo) in enumerate(zip(native, loaded, strict=True))])

    runs = _starts(start, starts, together)
    return {"identity": saved["identity"], "graphs": saved.get("graphs"), "starts": runs}


def decode_start(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [f"rank {x['rank']}: {x.get('load_error') or x.get('native_error')}"
              for x in ranks if "load_ms" not in x]
    if errors:
        refused = all("refused" in e for e in errors)
        return {"verdict": "fell back" if refused else "error", "why": "; ".join(errors)[:400]}
    bad = [f"rank {x['rank']}: tokens {x['tokens_identical']}, "
           f"outputs {x['outputs_identical']}/{x['outputs']}"
           for x in ranks
           if not all(x["tokens_identical"].values()) or x["outputs_identical"] != x["outputs"]]
    return {"verdict": "wrong" if bad else "identical", "why": "; ".join(bad),
            "verify_ms": [x.get("verify_ms") for x in ranks],
            "verify_parts_ms": [x.get("verify_parts_ms") for x in ranks]}  # where the canary's time went


def _cb_case(
    case: Case, env: dict[str, str], starts: int, together: int, work: Path, timeout: float
) -> dict[str, Any]:
    from ember_bench import cb

    arch = case.args["arch"]
    _, extra = ARCHITECTURES[arch]
    config = {"model_type": arch, **SMALL_CONFIG, **extra}
    (work / "config.json").write_text(json.dumps(config))
    store = work / "store"
    opts = {"model": arch, "model_config": str(work / "config.json"), "layers": None,
            "store": store.as_uri(), "store_dir": str(store), "work_dir": str(work)}

    lane = {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE")}  # run_child adds os.environ

    def child(phase: str, out: Path = work) -> dict[str, Any]:
        extra = case.args.get("load_env", {}) if phase == "load" else {}
        return cb.run_child(phase, opts, out, timeout, env={**lane, **(cb.phase_env(phase) or {}), **extra})

    native = child("native")
    if "error" in native:
        return {"error": f"native: {native['error']}", "log": native.get("log", "")[-600:]}
    saved = child("save")
    if "error" in saved or "archive" not in saved:
        return {"error": f"save: {saved.get('error') or 'no archive'}", "log": saved.get("log", "")[-600:]}
    opts["identity"] = saved["archive"]["identity"]
    ref = native.get("tokens")

    def start(i: int) -> dict[str, Any]:
        (work / f"start-{i}").mkdir(exist_ok=True)
        lo = child("load", work / f"start-{i}")
        if "error" in lo:
            return {"verdict": "error", "why": lo["error"][:400]}
        same = lo.get("tokens") == ref
        fell_back = lo.get("mode") == "native"
        why = lo.get("reason", "") if fell_back else "" if same else first_difference(ref, lo.get("tokens"))
        verdict = ("fell back" if fell_back else "identical") if same else "wrong"
        return {"verdict": verdict, "why": why, "verify_ms": lo.get("verify_ms"),
                "verify_parts_ms": lo.get("verify_parts_ms"), "canary_key": lo.get("canary_key")}

    runs = _starts(start, starts, together)
    return {"identity": opts["identity"], "save_identical": saved.get("tokens") == ref, "starts": runs}


def _starts(start: Callable[[int], dict[str, Any]], n: int, together: int) -> list[dict[str, Any]]:
    """`n` fresh starts, `together` at a time on the case's GPUs (each its own processes); each
    verdict on stderr as it comes, so a sweep cut short still says what its starts showed."""
    def one(i: int) -> dict[str, Any]:
        r = start(i)
        typer.echo(f"  start {i + 1}/{n}: {r['verdict']} {r.get('why', '')[:200]}", err=True)
        return r

    with ThreadPoolExecutor(max_workers=max(together, 1)) as pool:
        return list(pool.map(one, range(n)))


def first_difference(a: Any, b: Any) -> str:
    for w, (x, y) in enumerate(zip(a or [], b or [], strict=False)):
        for p, (s, t) in enumerate(zip(x, y, strict=False)):
            if s != t:
                pairs = enumerate(zip(s, t, strict=False))
                i = next((i for i, (u, v) in pairs if u != v), min(len(s), len(t)))
                return f"wave {w} prompt {p} token {i}"
    return "token lists differ in length"


def run_case(
    case: Case, lanes: Lanes, starts: int, work: Path, timeout: float, together: int = 1
) -> dict[str, Any]:
    out: dict[str, Any] = {"case": case.name, "kind": case.kind, "world": case.world}
    if case.kind != "cb":
        out["layers"] = case.args.get("layers") or "full"
    if "skip" in case.args:
        return {**out, "skipped": case.args["skip"]}
    gpus = lanes.take(case.world)
    typer.echo(f"{case.name}: on GPU {','.join(gpus)}", err=True)
    t = time.perf_counter()
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
        env.update(CUDA_VISIBLE_DEVICES=",".join(gpus), NCCL_NVLS_ENABLE="0")
        d = work / case.name.replace("/", "_")
        d.mkdir(parents=True, exist_ok=True)
        if case.kind == "cb":
            res = _cb_case(case, env, starts, together, d, timeout)
        else:
            # full-size models, one start at a time: five 8B LOADs beside each other on one GPU
            # could not map their saved extents and fell back (correctness-h200x4-20261127b)
            res = _decode_case(case, env, starts, 1, (d / "store").as_uri(), timeout)
    except Exception as exc:  # a case that cannot run says why; the others go on
        res = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        lanes.give(gpus)
    out.update(res, gpus=gpus, wall_s=round(time.perf_counter() - t, 1))
    if "starts" in out:
        verdicts = [s["verdict"] for s in out["starts"]]
        out["counts"] = {v: verdicts.count(v) for v in ("identical", "wrong", "fell back", "error")}
    return out


# ---- report ----------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Correctness sweep: {report['starts']} fresh LOAD starts per case", "",
             f"- device: {report['device']} x {report['gpus']}, date {report['date']}", "",
             "| case | world | wrong / N | identical | fell back | errors | wall s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        name = r["case"] + (f" ({r['layers']} layers)" if r.get("layers", "full") != "full" else "")
        if "counts" not in r:
            lines.append(f"| {name} | {r['world']} | - | | | | {r.get('wall_s', '')} | "
                         f"{(r.get('skipped') or r.get('error', ''))[:160]} |")
            continue
        c, n = r["counts"], len(r["starts"])
        note = next((s["why"] for s in r["starts"] if s["verdict"] != "identical" and s["why"]), "")
        lines.append(f"| {name} | {r['world']} | {c['wrong']} / {n} | {c['identical']} "
                     f"| {c['fell back']} "
                     f"| {c['error']} | {r['wall_s']} | {note[:160]} |")
    lines += ["", "wrong: tokens or graph outputs differ from native on any rank. fell back: LOAD refused "
              "and the engine captured natively (its tokens still compared, CB). A case with an error did "
              "not run to a verdict; its reason is in the note.", ""]
    return "\n".join(lines)


def bench_correctness(
    starts: Annotated[int, typer.Option(help="Fresh LOAD starts per case.")] = 10,
    cases: Annotated[str, typer.Option(help="Comma-separated patterns ('parallel/*,cb/mistral').")] = "*",
    out_dir: Annotated[Path, typer.Option(help="Where the reports go.")] = Path("benchmarks/results"),
    timeout: Annotated[float, typer.Option(help="Seconds per child process.")] = 900,
    list_cases: Annotated[bool, typer.Option("--list", help="Print the cases and exit.")] = False,
    together: Annotated[int, typer.Option(help="A CB case's LOAD starts run this many at a time on its GPU "
                                               "(small models: the sweep in less device time; decode "
                                               "cases, full-size, run one at a time).")] = 1,
    layers: Annotated[int, typer.Option(help="Depth of the decode and parallel cases' models (0: each "
                                             "workload's own); the report names it per case.")] = 0,
) -> None:
    """Native once, SAVE once, N fresh LOADs per case, compared with native: wrong starts / N."""
    try:
        import torch
    except ModuleNotFoundError:  # --list works anywhere; a sweep needs torch and GPUs
        torch = None
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    count = torch.cuda.device_count() if torch is not None else 0
    gpus = [g for g in ids.split(",") if g] if ids else [str(i) for i in range(count)]
    patterns = [p.strip() for p in cases.split(",") if p.strip()]
    chosen = [c for c in all_cases(len(gpus), layers) if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    if list_cases or not gpus or torch is None:
        typer.echo("\n".join(f"{c.name} (world {c.world}) {c.args.get('skip', '')}" for c in chosen))
        if not list_cases:
            typer.echo("no GPU (or no torch) here: the sweep runs on a GPU machine", err=True)
            raise typer.Exit(2)
        return
    chosen.sort(key=lambda c: -c.world)  # the wide cases first, while every GPU is free
    work = Path(tempfile.mkdtemp(prefix="ember-correctness-"))
    lanes, stamp = Lanes(gpus), time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    device = torch.cuda.get_device_name(0).replace(" ", "_")
    report: dict[str, Any] = {"device": device, "gpus": len(gpus), "starts": starts, "cases": [],
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(case: Case) -> None:
        r = run_case(case, lanes, starts, work, timeout, together)
        with lock:
            report["cases"].append(r)
            typer.echo(f"{case.name}: {r.get('counts') or r.get('skipped') or r.get('error')}", err=True)
            stem = f"correctness-{device}-{stamp}"
            (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
            (out_dir / f"{stem}.md").write_text(markdown(report))

    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        list(pool.map(one, chosen))
    report["cases"].sort(key=lambda r: r["case"])
    (out_dir / f"correctness-{device}-{stamp}.md").write_text(markdown(report))
    typer.echo(markdown(report))
    if any(r.get("counts", {}).get("wrong") for r in report["cases"]):
        raise typer.Exit(1)
