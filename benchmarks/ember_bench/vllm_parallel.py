"""`ember bench vllm --tp N | --ep | --dp N`: vLLM on N GPUs, native vs ONE single-GPU SAVE → N-rank LOAD.

The same shapes and random weights as `ember bench vllm` (`write_config`), run as a deployment
runs them: the identity's engine arguments (`ember.engines.vllm.args.engine_args`, with the
parallel pins) and a pod's environment (`ranks.pod_env`), on vLLM's async engine (what `vllm serve`
runs; the offline `LLM` refuses DP > 1):

1. `native` — plain vLLM on N GPUs, its own compile cache; where it serves no tokens (e.g. too
   little `--gpu-memory-utilization` for the weights and a KV cache) the bench stops there with
   the error its log names (`native_error`): nothing else could be compared;
2. `save` — the SAVE Job (`ember.engines.vllm.job.save_job`: sizing probe, then SAVE) on GPU 0
   alone, playing rank 0 of the world under libember_nccl;
3. `load` — vLLM on N GPUs under libember (EMBER_MODE=load), from an empty cache root: every
   worker restores the one archive; `--loads N` starts N such fresh LOADs (`loads_more`), and the
   summary counts those that restored on every rank and those that served other tokens than
   native (`wrong_loads`); a SAVE that published nothing gets one LOAD (its refusal, served
   natively), no `save_tp1`, and the summary says why (`save_error`);
4. `reference` — a LOAD that sets up as ever (the archive's compiled code and KV size, one GPU
   per worker) and then lets vLLM capture its graphs (EMBER_VLLM_CAPTURE_NATIVELY): what this pod
   computes natively, so `wrong_loads_vs_reference` counts LOADs whose restored graphs changed a
   token, and `reference_identical_to_native` says whether the archive's code itself computes
   native's tokens;
5. `native_again` — native once more, compiling from an empty cache as the first did: its tokens
   must repeat the first run's, or no token comparison at this shape can judge a restore
   (`native_reproducible`);
6. with `--diagnose`, three runs that tell where a pod's tokens part from native's
   (`identical_to_native`): `native_save_code`, plain vLLM on a copy of SAVE's cache root (with
   EMBER_VLLM_MEGA_AOT=1, set to load compiled code as SAVE stored it) (rank 0 runs the archive's
   compiled code without libember; SAVE compiled no other rank's, so the
   others compile their own); `load_unarchived`, a LOAD without an archive (libember, a GPU per
   worker, refused: vLLM compiles and captures itself), and where that differs from native,
   `load_unarchived_all_gpus`, the same with every worker seeing every GPU (libember alone);
   `native_kv_bytes`, native given SAVE's KV size as a pod is (vLLM skips its profiling run);
7. with `--floor`, `floor`: native on a copy of native's cache root (its compiled code, and its
   Triton kernels moved where a warm start looks: `seed_triton_home`), so it compiles nothing
   (`triton_compiled.floor`), given SAVE's KV size as a pod is (no profiling run). Less its graph
   capture (the slowest rank's), that is the start a restore cannot shorten: `engine_init_floor_s`,
   `engine_init_floor_over_native`; and `engine_init_load_over_warm_native` compares a LOAD with
   vLLM's own cache. (`--enforce-eager` is no floor: eager vLLM's warm-up took 18.7 s per rank,
   benchmarks/results/h200x2-20261130f);
8. `save_tp1` (unless `--no-tp1-save`) — the SAVE Job of the same model at TP=1, the time the
   shape's SAVE is held to (its goal: no longer).

Per run: engine init, start → first token, greedy tokens at each batch size (each batch's requests
scheduled together, their token ids from the whole vocabulary; with data parallel, on each DP rank
in turn; compared with native), Inductor's autotuning choices its cache root holds (`autotune`: a
reduction's config decides its summation order, so the same compiled code computes other bits under
another choice; the summary's `autotune_differs_from_native` counts reductions whose choice differs
from native's), the code Inductor generated (`compiled_code`, digests of its files' source less the
paths in comments and the Triton backend hash; `code_not_in_native`: the files a LOAD ran, SAVE's,
that native never generated; `triton_backends`: the backend hashes, which name the ptxas);
per rank (the plugin's report files): how its graphs came (`restored` / `native`), capture or LOAD
seconds, the splice's part, vLLM's worker stages. Report:
`benchmarks/results/vllm-<device>-<model>-<shape>.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from ember.engines.vllm import report as reports
from ember.engines.vllm.args import COMPILE_ENV, mega_aot

CHILD = r"""
import time
T0 = time.perf_counter()
import asyncio, json, sys
from ember_bench.vllm_child import decode_step_ms, generate_together, greedy_tokens, prompts


async def main(args):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    imported = time.perf_counter() - T0
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns, _ = parser.parse_known_args(args["engine_args"])
    t = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(ns))
    init = time.perf_counter() - t

    async def run(batch, seed, params):
        return await generate_together(llm, prompts(batch, args.get("vocab", 30000), seed), params, f"{seed}")

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    greedy = params(args["max_tokens"])
    await run(1, 0, params(1))
    first = time.perf_counter() - T0
    tokens = await greedy_tokens(llm, args["batch_sizes"], args.get("vocab", 30000), greedy,
                                 args.get("data_parallel", 1))
    timed = args.get("decode_batches") or []
    steps = {str(b): await decode_step_ms(llm, b, args["decode_steps"]) for b in timed}
    llm.shutdown()
    return {"engine_init_s": round(init, 3), "first_token_s": round(first, 3), "import_s": round(imported, 3),
            "tokens": tokens,
            "decode_step_ms": steps}


a = json.loads(sys.argv[1])
res = asyncio.run(main(a))
with open(a["out"], "w") as f:
    json.dump(res, f)
print("CHILD OK", json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
"""


def shape_identity(cfg: Path, tensor: int, expert: bool, data: int) -> Any:
    """The identity a deployment of this shape gets (5 capture sizes, as the GPU tests): a dense
    model's data parallel replicas restore the data-1 archive (args.archived)."""
    from ember.engines.vllm.args import archived, identity_workload
    from ember.identity import ArchiveIdentity, Parallelism

    par = archived(Parallelism(tensor=tensor, data=data, expert=tensor * data if expert else 1))
    return ArchiveIdentity(model=str(cfg), engine="vllm", engine_version="0.26",
                           capture_sizes=(1, 2, 4, 8, 16), graph_mode="full-and-piecewise",
                           max_num_tokens=2048, max_batch=16, parallelism=par,
                           workload=identity_workload())


def shape_name(tensor: int, expert: bool, data: int) -> str:
    parts = [f"tp{tensor}"] if tensor > 1 else []
    parts += [f"ep{tensor * data}"] if expert else []
    parts += [f"dp{data}"] if data > 1 else []
    return "-".join(parts) or "tp1"


def extra_args(gpu_memory_utilization: float) -> list[str]:
    return ["--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization",
            str(gpu_memory_utilization), "--max-model-len", "2048", "--seed", "0"]


def child_env(mode: str, args: list[str], work: Path, extra: dict[str, str], pinned: bool = True,
              fresh: bool = False) -> dict[str, str]:
    """`pinned=False`: vLLM's own environment for the shape, not a pod's (`bench vllm --pins-cost`);
    `fresh`: from an empty cache root (a LOAD's always is)."""
    from ember.engines.vllm import compile_cache
    from ember.engines.vllm.args import process_env
    from ember.engines.vllm.ranks import pod_env

    env = process_env(mode, {**os.environ, **(pod_env(args) if pinned else {})})
    cache = work / f"vllm-cache-{mode}{'-fresh' if fresh and mode != 'load' else ''}"
    if mode == "load" or fresh:  # a fresh pod (a LOAD's compiled code comes from the archive)
        shutil.rmtree(cache, ignore_errors=True)
    # Triton's default cache under the run's root too (SAVE and LOAD set the same themselves): no run
    # finds kernels in the `~/.triton` an earlier run on the machine left
    env.update(VLLM_CACHE_ROOT=str(cache), TRITON_HOME=str(cache / compile_cache.TRITON_HOME),
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0",
               PYTHONUNBUFFERED="1", **extra)
    return env


def run_engine(mode: str, args: list[str], work: Path, extra: dict[str, str], options: dict[str, Any],
               timeout: float, name: str = "", pinned: bool = True, fresh: bool = False,
               seed: Path | None = None) -> dict[str, Any]:
    """One N-GPU engine process (its files named `name`, else `mode`); its result with every
    rank's report (`ranks`). `pinned`, `fresh`: see child_env; `seed`: the run's cache root is a
    copy of this one (`vllm-cache-<name>`), so it runs the code another run compiled."""
    from ember.engines.vllm import compile_cache
    from ember_bench.vllm import run_session

    name = name or mode
    out, logf = work / f"{name}.json", work / f"{name}.log"
    report = work / f"{name}-report" / "vllm-report.json"
    out.unlink(missing_ok=True)
    report.parent.mkdir(parents=True, exist_ok=True)
    reports.clear(report)
    env = child_env(mode, args, work, {"EMBER_VLLM_REPORT": str(report), **extra}, pinned, fresh)
    if seed is not None:
        cache = work / f"vllm-cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(seed, cache, symlinks=True)
        seed_triton_home(cache)
        env.update(VLLM_CACHE_ROOT=str(cache), TRITON_HOME=str(cache / compile_cache.TRITON_HOME))
    child = json.dumps({**options, "engine_args": args, "out": str(out)})
    t, since = time.perf_counter(), time.time()
    rc = run_session([sys.executable, "-c", CHILD, child], env, logf, timeout)
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    root = Path(env["VLLM_CACHE_ROOT"])
    res.update(mode=mode, rc=rc, process_wall_s=round(time.perf_counter() - t, 3), ember=reports.read(report),
               autotune=autotune_choices(root), triton_compiled_kernels=triton_compiled_kernels(root, since),
               compiled_code=compiled_code(root), triton_backends=triton_backends(root))
    res["triton_compiled"] = len(res["triton_compiled_kernels"])
    if rc != 0 or not out.exists():
        res["log_tail"] = logf.read_text()[-6000:]
    typer.echo(f"{name}: rc={rc} first_token={res.get('first_token_s')}")
    return res


def seed_triton_home(root: Path) -> int:
    """Copy the Triton kernels a cold start left in Inductor's per-compile directories into the
    root's Triton home; how many. Inductor points Triton there while it compiles, so vLLM's own
    kernels, compiled at warm-up in the same process, land there too, and a warm start (which loads
    the compiled code, no Inductor) never looks there: it compiled 24 of them again, 18 s of its
    warm-up (benchmarks/results/h200x2-20261130g). A floor compiles nothing."""
    from ember.engines.vllm import compile_cache

    dest, n = root / compile_cache.TRITON_HOME / ".triton" / "cache", 0
    for kernel in sorted(root.rglob("inductor_cache/triton/*/*")):
        if kernel.is_dir() and not (dest / kernel.name).exists():
            shutil.copytree(kernel, dest / kernel.name)
            n += 1
    return n


def triton_compiled_kernels(root: Path, since: float) -> list[str]:
    """Triton kernels compiled under a run's cache root while it ran (each compile writes its group
    file, `__grp__<name>.json`; what an archive brought keeps SAVE's times), each as
    `<cache directory>/<kernel>` relative to the root: which kernels, and whether they went to the
    Triton home a LOAD looks in or to a directory Inductor chose."""
    groups = root.rglob("__grp__*.json") if root.is_dir() else []
    return sorted(f"{g.parent.parent.relative_to(root)}/{g.name[len('__grp__'):-len('.json')]}"
                  for g in groups if g.stat().st_mtime >= since - 1)


TIMING = ("time_taken_ms", "triton_cache_hash")  # in a best_config, not part of the choice


def autotune_choices(root: Path) -> dict[str, Any]:
    """The config Inductor's runtime autotuning chose for each kernel of several configs (its
    `*.best_config` beside the kernel, written at the kernel's first launch; an archive carries
    SAVE's), by file name, without its timing."""
    out: dict[str, Any] = {}
    for path in sorted(root.rglob("*.best_config")) if root.is_dir() else []:
        try:
            chosen = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(chosen, dict):
            out[path.name] = {k: v for k, v in chosen.items() if k not in TIMING}
    return out


def compiled_code(root: Path) -> list[str]:
    """The code Inductor generated under a run's cache root (the graphs' wrappers and their
    kernels), each by a digest of its source less its `# kernel path:` comments and its kernels'
    `backend_hash`: the comments name the run's own cache root, so the same wrapper compiled under
    two roots has two file names (h200x2-20261130g counted 3 such "new" files); the backend hash
    names the ptxas Triton compiles with, which ember's processes pin (`triton_backends` reports
    it apart). Two runs compiled the same code where they hold the same digests (a rank's kernels
    name its device: rank 1's differ)."""
    files = root.rglob("inductor_cache/*/*.py") if root.is_dir() else []
    sources = (BACKEND_HASH.sub(b"", KERNEL_PATH.sub(b"", p.read_bytes())) for p in files)
    return sorted({hashlib.sha256(src).hexdigest()[:16] for src in sources})


def triton_backends(root: Path) -> list[str]:
    """The Triton backend hashes (compiler and ptxas) a run's generated kernels name, 12 digits
    each: ember's SAVE and LOAD name torch's ptxas (`compile_cache.pin_ptxas`), so theirs may
    differ from a plain vLLM's (h200-20261203: every kernel's source otherwise the same)."""
    files = root.rglob("inductor_cache/*/*.py") if root.is_dir() else []
    return sorted({m.group(1).decode()[:12] for p in files for m in BACKEND_HASH.finditer(p.read_bytes())})


KERNEL_PATH = re.compile(rb"^# kernel path: .*$", re.MULTILINE)
BACKEND_HASH = re.compile(rb"'backend_hash': '([0-9A-Fa-f]+)'")


def code_not_in(run: dict[str, Any], native: dict[str, Any]) -> int | None:
    """How many of a run's generated files native never generated (None when either has none)."""
    mine, theirs = run.get("compiled_code") or [], native.get("compiled_code") or []
    return len(set(mine) - set(theirs)) if mine and theirs else None


def autotune_differs(run: dict[str, Any], native: dict[str, Any]) -> int:
    """Reductions (a config with an `R0_BLOCK`) both runs chose a config for, each choosing
    another: a pointwise kernel's block size changes no result, a reduction's changes its order."""
    mine, theirs = run.get("autotune") or {}, native.get("autotune") or {}
    return sum(1 for name in mine.keys() & theirs.keys()
               if mine[name] != theirs[name] and "R0_BLOCK" in {*mine[name], *theirs[name]})


def run_save(ident: Any, args_extra: list[str], work: Path, timeout: float) -> dict[str, Any]:
    """The SAVE Job on GPU 0 alone, as rank 0 of the identity's world."""
    from ember.engines.vllm.job import JobFailed, save_job

    saved = dict(os.environ)
    os.environ.update({"VLLM_CACHE_ROOT": str(work / "vllm-cache-save"), "VLLM_USE_FLASHINFER_SAMPLER": "0",
                       "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": saved.get("CUDA_VISIBLE_DEVICES", "0")
                       .split(",")[0]})
    t = time.perf_counter()
    try:
        summary = save_job(ident.model_dump_json(), (work / "store").as_uri(), args_extra, work=work / "job",
                           timeout=timeout)
    except JobFailed as exc:
        summary = {"published": False, "error": str(exc)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    summary["save_job_s"] = round(time.perf_counter() - t, 3)
    typer.echo(f"save: published={summary.get('published')} in {summary['save_job_s']} s")
    return dict(summary)


def per_rank(res: dict[str, Any]) -> dict[str, Any]:
    """Each rank's figures from its report file (a world of one: the report is rank 0's)."""
    report = res.get("ember") or {}
    ranks = report.get("ranks") or ({"0": report} if report.get("stages") else {})
    out = {}
    for r, one in sorted(ranks.items(), key=lambda kv: int(kv[0])):
        st = one.get("stages") or {}
        load = st.get("load") or {}
        timings = load.get("timings") or {}
        out[r] = {
            "capture_how": (st.get("capture") or {}).get("how"),
            "capture_s": (st.get("capture") or {}).get("seconds"),
            "refusal": (st.get("load_refused") or st.get("refused") or {}).get("reason"),
            "graphs": load.get("graphs"),
            "splice_ms": timings.get("splice_now_ms") or timings.get("splice_ms"),
            "verify_ms": reports.verify_cost(one).get("verify_ms"),  # LOAD's canary, this rank
            "verify_parts_ms": reports.verify_cost(one).get("parts_ms"),
            "verify_ok": reports.verify_cost(one).get("ok"),
            "verify_pieces": reports.verify_cost(one).get("pieces"),  # PIECEWISE pieces it compared
            "verify_kv": reports.verify_cost(one).get("kv"),  # the steps that wrote and read real KV
            "worker_stages_s": {k.removeprefix("worker."): v.get("seconds") for k, v in st.items()
                                if k.startswith("worker.")},
        }
    return out


def ab_env(ab: Sequence[str], index: int) -> dict[str, str]:
    """The settings `--ab` gives LOAD `index`: with k of them, LOADs cycle through none and each
    (`--ab A=1 --ab B=0`: LOAD 0 none, 1 A=1, 2 B=0, 3 none, ...). One `--ab` may hold several
    settings, comma-separated."""
    label = ab_label(ab, index)
    return dict(one.partition("=")[::2] for one in label.split(",")) if label else {}


def ab_label(ab: Sequence[str], index: int) -> str:
    """The `--ab` LOAD `index` runs with ("" for none)."""
    group = index % (len(ab) + 1)
    return ab[group - 1] if group else ""


def ab_loads(every: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each group of an A/B run's LOADs (`without` a setting, then one per `--ab`): their engine
    init and canary spreads, the worker's `compile_or_warm_up_model` (restore and canary inside)
    and what of it comes after ember's capture stage returns (vLLM's own warm-up: the step it runs
    there is the process's first unless a canary ran before it)."""
    if not any("ab" in r for r in every):
        return None

    def group(runs: list[dict[str, Any]]) -> dict[str, Any]:
        ranks = [rank.get("worker_stages_s", {}) | {"capture_s": rank.get("capture_s")}
                 for r in runs for rank in per_rank(r).values()]
        stage = [x.get("compile_or_warm_up_model") for x in ranks]
        after = [x["compile_or_warm_up_model"] - x["capture_s"] for x in ranks
                 if x.get("compile_or_warm_up_model") is not None and x.get("capture_s") is not None]
        return {"loads": len(runs), **spreads(runs), "compile_or_warm_up_model_s": spread(stage),
                "after_capture_s": spread(after)}

    labels = dict.fromkeys(r.get("ab") or "without" for r in every)
    return {label: group([r for r in every if (r.get("ab") or "without") == label]) for label in labels}


def spreads(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """Every LOAD's engine init and every rank's canary, not the first LOAD's alone: one start is
    no measure of a start; and each LOAD's Triton kernels compiled (at a start, the goal is none)."""
    canaries = [rank.get("verify_ms") for r in loads for rank in per_rank(r).values()]
    return {"engine_init_s_loads": spread([r.get("engine_init_s") for r in loads]),
            "verify_ms_loads": spread(canaries),
            "triton_compiled_loads": [r.get("triton_compiled") for r in loads]}


def spread(values: list[Any]) -> dict[str, float] | None:
    """min, median and max of the values given (None ones left out); None when there are none."""
    got = sorted(float(v) for v in values if v is not None)
    if not got:
        return None
    return {"min": round(got[0], 3), "median": round(statistics.median(got), 3), "max": round(got[-1], 3)}


def ratio(num: Any, den: Any) -> float | None:
    """num / den rounded, None where either is missing or den is 0."""
    return round(float(num) / float(den), 3) if num is not None and den else None


def bench_shape(model: str, layers: int, tp: int, ep: int, dp: int, run: Any = None, **kw: Any) -> Path:
    """`--tp/--ep/--dp` as given: EP alone is attention data parallel (data = N); EP must be
    tensor x data (vLLM's expert-parallel size). `run`: the bench (default `bench_parallel`)."""
    if ep > 1 and tp * dp == 1:
        dp = ep
    if ep > 1 and ep != tp * dp:
        raise typer.BadParameter(f"--ep {ep} must be tensor x data = {tp * dp}")
    return (run or bench_parallel)(model, layers, tp, ep > 1, dp, **kw)


def bench_parallel(model: str, layers: int, tensor: int, expert: bool, data: int, *, work: Path,
                   out_dir: Path, batch_sizes: list[int], max_tokens: int, gpu_memory_utilization: float,
                   timeout: float, tp1_save: bool = True, loads: int = 1, diagnose: bool = False,
                   floor: bool = False, ab: Sequence[str] = ()) -> Path:
    """native N-rank → one single-GPU SAVE → `loads` fresh N-rank LOADs → native again; the
    report's path. `diagnose`: three more runs that tell where a pod's tokens part from native's;
    `floor`: vLLM's own warm start, which compiles nothing (module doc, 7.); `ab` (["KEY=VALUE"]):
    the LOADs cycle through none and each setting (`ab_env`, `ab_loads`)."""
    from ember.engines.vllm.args import pod_args
    from ember_bench.vllm import write_config
    from ember_bench.vllm_report import _store_bytes

    name = shape_name(tensor, expert, data)
    work = work.absolute() / f"{model}-{layers or 'all'}l-{name}"
    cfg = write_config(model, layers or None, work / "config")
    ident = shape_identity(cfg, tensor, expert, data)
    extra = extra_args(gpu_memory_utilization)
    args = [*pod_args(ident, data), *extra]
    # prompt ids from the whole vocabulary: every tensor rank's shard of the embedding looks some up
    vocab = int(json.loads((cfg / "config.json").read_text())["vocab_size"])
    options = {"batch_sizes": batch_sizes, "max_tokens": max_tokens, "vocab": vocab, "data_parallel": data}
    results: dict[str, Any] = {"native": run_engine("native", args, work, {}, options, timeout, fresh=True)}
    if why := failure(results["native"]):  # nothing to compare a restore with: the rest would be spent
        path = _write(out_dir, model, name, {"shape": name, "model": model, "identity": ident.hash(),
                                             "native_error": why}, results)
        typer.echo(f"native vLLM failed ({why}); stopped before SAVE: {path}", err=True)
        raise typer.Exit(1)
    results["save"] = run_save(ident, extra, work, timeout)
    if floor:  # vLLM's own warm start: native's compiled code and kernels, a pod's KV size
        results["floor"] = run_engine("native", [*args, *kv_bytes_args(results["save"])], work, {}, options,
                                      timeout, name="floor", seed=work / "vllm-cache-native-fresh")
    archive = {"EMBER_VLLM_ARCHIVE": str(work / "store" / "archives" / ident.hash())}
    # each from an empty cache root: a fresh pod; without an archive one LOAD shows the refusal
    starts = max(1, loads) if results["save"].get("published") else 1
    every = [run_engine("load", args, work, {**archive, **ab_env(ab, i)}, options, timeout,
                        name=f"load-{i}" if i else "load") for i in range(starts)]
    if ab:
        for i, run in enumerate(every):
            run["ab"] = ab_label(ab, i)
    results["load"], results["loads_more"] = every[0], every[1:]
    if results["save"].get("published"):  # this pod with the graphs vLLM captures
        natively = {**archive, "EMBER_VLLM_CAPTURE_NATIVELY": "1"}
        results["reference"] = run_engine("load", args, work, natively, options, timeout, name="reference")
    if diagnose and results["save"].get("published"):
        results.update(diagnoses(args, work, options, timeout, results))
    # native's own repeatability, compiling afresh: tokens two native pods disagree on judge no restore
    results["native_again"] = run_engine("native", args, work, {}, options, timeout, name="native-again",
                                         fresh=True)
    if tp1_save and tensor * data > 1 and results["save"].get("published"):  # needs the shape's SAVE
        results["save_tp1"] = run_save(shape_identity(cfg, 1, False, 1), extra, work / "tp1", timeout)
    summary = {"shape": name, "model": model, "layers": layers, "identity": ident.hash(),
               "ab": list(ab) or None, "ab_loads": ab_loads(every),
               **summarize(results), "archive_bytes": _store_bytes(work / "store"),
               "compiled_with": archive_facts(work / "store", ident.hash()).get("compiled_with")}
    path = _write(out_dir, model, name, summary, results)
    typer.echo(json.dumps(summary, indent=1, default=str))
    return path


def _write(out_dir: Path, model: str, name: str, summary: dict[str, Any], results: dict[str, Any]) -> Path:
    from ember_bench.vllm_report import _device

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{_device()}-{model}-{name}.json"
    path.write_text(json.dumps({"summary": summary, "runs": results}, indent=1, default=str))
    return path


def failure(run: dict[str, Any]) -> str:
    """'' for a run that served tokens, else why not: the last error its log names (e.g. vLLM's
    "No available memory for the cache blocks"), else its exit status."""
    if run.get("rc") in (0, None) and run.get("tokens"):
        return ""
    errors = re.findall(r"\b(\w+(?:Error|Exception): [^|\n]+)", run.get("log_tail") or "")
    return errors[-1].strip()[:300] if errors else f"exit status {run.get('rc')}, no tokens"


def diagnoses(args: list[str], work: Path, options: dict[str, Any], timeout: float,
              results: dict[str, Any]) -> dict[str, Any]:
    """`--diagnose`'s runs (module doc, 6.), after the LOADs: each is compared with native."""
    out = {
        # plain vLLM on SAVE's compiled code (loaded as SAVE stored it)
        "native_save_code": run_engine("native", args, work, dict(COMPILE_ENV) if mega_aot() else {}, options,
                                       timeout, name="native-save-code", seed=work / "vllm-cache-save"),
        # a pod's set-up (libember, a GPU per worker) compiling and capturing itself
        "load_unarchived": run_engine("load", args, work, {}, options, timeout, name="load-unarchived"),
    }
    if out["load_unarchived"].get("tokens") != results["native"].get("tokens"):  # split the set-up
        out["load_unarchived_all_gpus"] = run_engine("load", args, work, {"EMBER_VLLM_ONE_GPU": "0"}, options,
                                                     timeout, name="load-unarchived-all-gpus")
    # native sized as a pod is, by SAVE's KV bytes: vLLM then skips its memory-profiling run
    out["native_kv_bytes"] = run_engine("native", [*args, *kv_bytes_args(results["save"])], work, {}, options,
                                        timeout, name="native-kv-bytes", fresh=True)
    return out


def archive_facts(store: Path, identity_hash: str) -> dict[str, Any]:
    """The published archive's engine facts ({} without one): at TP > 1 its `compiled_with` names
    the embedding patch SAVE's compiled code was traced with (ember.engines.vllm.parallel)."""
    from ember.archive import bundle

    try:
        return dict(bundle.open_archive(str(store), identity_hash).manifest.engine)
    except Exception:  # nothing published, or unreadable: the summary says None
        return {}


DIAGNOSES = ("native_save_code", "load_unarchived", "load_unarchived_all_gpus", "native_kv_bytes")


def kv_bytes_args(save: dict[str, Any]) -> list[str]:
    """The KV-cache size SAVE ran with (and a pod runs with), as vLLM's flag; [] when unknown."""
    args = [str(a) for a in save.get("args") or []]
    if "--kv-cache-memory-bytes" not in args:
        return []
    i = args.index("--kv-cache-memory-bytes")
    return args[i:i + 2]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The goals' figures from the runs: the first LOAD's times and ranks; over every LOAD, how
    many restored on every rank, served other tokens than native (`wrong_loads`, nothing counts
    too: `failed_loads`) or than this pod's own capture (`wrong_loads_vs_reference`)."""
    native, load, reference = results["native"], results["load"], results.get("reference") or {}
    floor = results.get("floor") or {}
    every = [load, *results.get("loads_more", [])]
    tokens, ref_tokens = native.get("tokens"), reference.get("tokens")
    # the floor: vLLM's warm start less its capture (the slowest rank's: the ranks capture together)
    captures = [r.get("capture_s") or 0.0 for r in per_rank(floor).values()]
    init = floor.get("engine_init_s")
    floor_s = round(init - max(captures, default=0.0), 3) if init else None

    def wrong(against: Any) -> int:
        return sum(1 for r in every if not r.get("tokens") or r.get("tokens") != against)

    return {
        "restored_every_rank": reports.ranks_restored(load.get("ember") or {}),
        "tokens_identical_to_native": bool(load.get("tokens")) and load.get("tokens") == tokens,
        "native_reproducible": bool(tokens) and (results.get("native_again") or {}).get("tokens") == tokens,
        "reference_identical_to_native": bool(ref_tokens) and ref_tokens == tokens if reference else None,
        "loads": len(every),
        "loads_restored_every_rank": sum(reports.ranks_restored(r.get("ember") or {}) for r in every),
        "wrong_loads": wrong(tokens),
        "failed_loads": sum(1 for r in every if failure(r)),
        "loads_agree": all(r.get("tokens") == load.get("tokens") for r in every),  # a race differs in some
        "wrong_loads_vs_reference": wrong(ref_tokens) if ref_tokens else None,
        # --diagnose: what a difference follows (SAVE's code, a pod's set-up, or its KV sizing)
        "identical_to_native": {run: bool(results[run].get("tokens")) and results[run].get("tokens") == tokens
                                for run in DIAGNOSES if results.get(run)},
        "triton_compiled": {  # Triton kernels each run compiled: at a LOAD's start the goal is none
            run: results[run].get("triton_compiled") for run in ("native", "load", "reference", "floor")
            if results.get(run)},
        "code_not_in_native": {run: code_not_in(results[run], native) for run in ("load", "native_again")
                               if results.get(run)},  # 0: SAVE generated native's code, choices aside
        "triton_backends": {run: results.get(run, {}).get("triton_backends") for run in ("native", "load")},
        "autotune_differs_from_native": {
            run: autotune_differs(results[run], native) for run in ("load", "reference", "native_again")
            if results.get(run)},
        "engine_init_s": {"native": native.get("engine_init_s"), "load": load.get("engine_init_s"),
                          "reference": reference.get("engine_init_s")},
        "engine_init_load_over_native": ratio(load.get("engine_init_s"), native.get("engine_init_s")),
        **spreads(every),
        # the graphs' own part: the reference has the archive's compiled code too, and captures
        "engine_init_load_over_reference": ratio(load.get("engine_init_s"), reference.get("engine_init_s")),
        # --floor: the part of native's init no restore can remove, and LOAD's init above it
        "engine_init_floor_s": floor_s,
        "engine_init_floor_over_native": ratio(floor_s, native.get("engine_init_s")),
        "engine_init_load_over_warm_native": ratio(load.get("engine_init_s"), floor.get("engine_init_s")),
        "first_token_s": {"native": native.get("first_token_s"), "load": load.get("first_token_s")},
        # of which vLLM's import (an image's, with its bytecode compiled, is shorter)
        "import_s": {"native": native.get("import_s"), "load": load.get("import_s")},
        "save_published": bool(results["save"].get("published")),
        "save_error": results["save"].get("error"),
        "save_job_s": results["save"].get("save_job_s"),
        "save_job_s_tp1": (results.get("save_tp1") or {}).get("save_job_s"),
        "save_over_tp1_save": ratio(results["save"].get("save_job_s"),
                                    (results.get("save_tp1") or {}).get("save_job_s")),
        "ranks": {"native": per_rank(native), "load": per_rank(load)},
    }
