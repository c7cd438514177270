"""`ember bench vllm-switch`: a parallelism switch of vLLM on one GPU machine, restored vs native.

An EP=2 engine (by default; any `--from-tp/--from-ep`) serves a steady trickle of requests; then
the new shape (`--to-tp/--to-ep`, EP=4 by default) is started on the same machine while the old
one keeps serving, sharing its GPUs (each engine gets `--memory-fraction` of every GPU it uses),
once restored from its pre-saved archive and once natively (no archive: vLLM compiles and
captures), then natively on the cache that left. The first two are fresh pods: a fresh vLLM
cache root each (the restored one gets the compiled code from the archive); all run the engine
arguments of the identity (`ember.engines.vllm.args`, with the parallel pins) and a pod's
environment (`ranks.pod_env`), as `ember bench vllm --tp/--ep`.

1. SAVE both identities first, each by the SAVE Job (`vllm_parallel.run_save`: sizing probe and
   SAVE on ONE GPU, the first one, playing rank 0 of its world); SAVE time of each;
2. the old shape, restored from its archive, on the first GPUs; once its first token is out, a
   trickle of requests (`--interval`, open loop) for `--baseline` seconds before any switch;
3. each switch (`--variants`, default restored, native, native-warm): the time is taken, the new shape's
   engine process is started (`vllm_switch_child`, role `switch`), and switch → first token is
   until that process has its first token (one request, one token) — process start, `import
   vllm`, the engine's start (weights, compile or the archive's compiled code, KV cache, graphs
   captured or restored) and the first request are all in it, nothing is started ahead. Then
   greedy tokens at each batch size (per DP rank with data parallel ranks), and the new engine
   shuts down; 5 s (`Options.settle_s`) before the next switch. `native-warm` is native again on the
   vLLM cache the native start left (compiled code warm, graphs still captured): what vLLM's own
   cache gives a pod that has it;
4. the old shape is stopped; its trickle gives requests served / failed, p50 / p99 latency before
   the switches and within each (switch → the new shape's first token; switch → its exit).

Per rank of the new shape (the plugin's report files): restored or native, the reason of a
refusal, LOAD and splice seconds, vLLM's worker stages, graphs vLLM counts as captured at start
and while serving. Tokens: restored vs native of the new shape. Report:
`benchmarks/results/vllm-switch-<device>-<model>-<old>-to-<new>.{json,md}` (`vllm_switch_report`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ember.engines.vllm import report as reports
from ember.engines.vllm.compile_cache import TRITON_HOME
from ember_bench.vllm_switch_plan import Plan, Shape, plan, shape, variants_problem, visible_gpus
from ember_bench.vllm_switch_report import write_report

VARIANTS = ("restored", "native", "native-warm")
MODES = {"restored": "load", "native": "native", "native-warm": "native"}
CHILD_MODULE = "ember_bench.vllm_switch_child"  # the engine process (`python -m`)


@dataclass(frozen=True)
class Options:
    model: str = "qwen3-moe"
    layers: int = 4
    memory_fraction: float = 0.35
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 16
    interval_s: float = 0.25
    trickle_tokens: int = 8
    baseline_s: float = 10.0
    settle_s: float = 5.0
    request_timeout_s: float = 60.0
    timeout: float = 600.0  # a SAVE Job; an engine's start up to its first token
    after_first_s: float = 300.0  # a new shape's greedy batches and shutdown after its first token
    reuse_saves: bool = False


@dataclass
class Running:
    """An engine process of the bench and its files."""

    name: str
    proc: subprocess.Popen[bytes]
    run: Path
    started_mono: float

    @property
    def events(self) -> Path:
        return self.run / "events.json"

    @property
    def out(self) -> Path:
        return self.run / "result.json"

    @property
    def report(self) -> Path:
        return self.run / "report" / "vllm-report.json"

    @property
    def requests_log(self) -> Path:
        return self.run / "requests.jsonl"


def identity_of(cfg: Path, s: Shape) -> Any:
    from ember_bench.vllm_parallel import shape_identity

    return shape_identity(cfg, s.tensor, s.expert, s.data)


def engine_args_of(ident: Any, memory_fraction: float) -> list[str]:
    from ember.engines.vllm.args import engine_args
    from ember_bench.vllm_parallel import extra_args

    return [*engine_args(ident), *extra_args(memory_fraction)]


@contextlib.contextmanager
def only_gpu(gpu: str) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES=gpu for what runs inside (the SAVE Job's children inherit it)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def save(ident: Any, p: Plan, work: Path, opts: Options) -> dict[str, Any]:
    """The SAVE Job of one identity on the plan's SAVE GPU; the archive's directory with it."""
    from ember_bench.vllm_parallel import extra_args, run_save

    archive = work / "store" / "archives" / ident.hash()
    if opts.reuse_saves and (archive / "manifest").exists():
        typer.echo(f"save {ident.hash()}: reusing {archive}")
        return {"published": True, "reused": True, "archive": str(archive)}
    shutil.rmtree(work, ignore_errors=True)  # never an earlier run's archive under this identity
    work.mkdir(parents=True)
    with only_gpu(p.save_gpu):
        out = run_save(ident, extra_args(opts.memory_fraction), work, opts.timeout)
    out["archive"] = str(archive)
    return out


def spawn(name: str, mode: str, args: list[str], gpus: tuple[str, ...], work: Path,
          child: dict[str, Any], archive: str = "", cache: Path | None = None) -> Running:
    """Start one engine process (`mode`: load, under libember with `archive`; native: plain vLLM)
    in a fresh run folder and a fresh vLLM cache root (or `cache`, an earlier run's)."""
    from ember_bench.vllm_parallel import child_env

    run = work / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    (run / "report").mkdir(parents=True)
    extra = {"EMBER_VLLM_REPORT": str(run / "report" / "vllm-report.json"),
             "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    if archive:
        extra["EMBER_VLLM_ARCHIVE"] = archive
    env = child_env(mode, args, run, extra)
    if cache is not None:  # Triton's home goes with it (vllm_parallel.child_env)
        env.update(VLLM_CACHE_ROOT=str(cache), TRITON_HOME=str(cache / TRITON_HOME))
    spec = json.dumps({**child, "engine_args": args, "events": str(run / "events.json"),
                       "out": str(run / "result.json"), "requests_log": str(run / "requests.jsonl")})
    started = time.monotonic()
    with open(run / "engine.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, spec], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    typer.echo(f"{name}: started on GPUs {','.join(gpus)} ({mode})")
    return Running(name=name, proc=proc, run=run, started_mono=started)


def first_token(r: Running, timeout: float) -> float | None:
    """The monotonic time of the process's first token; None when it ended or timed out first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            t = json.loads(r.events.read_text()).get("first_token_mono")
            if t:
                return float(t)
        if r.proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def finish(r: Running, timeout: float) -> dict[str, Any]:
    """Wait for the process (killed, its whole session, after `timeout`); its result, its ranks'
    reports and the log's tail when it failed."""
    try:
        rc: int | str = r.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(r)
        rc = f"killed after {timeout:.0f} s"
    reap(r)
    res: dict[str, Any] = {}
    for part in (r.events, r.out):  # the events first: an engine that died after its first token
        with contextlib.suppress(OSError, ValueError):
            res.update(json.loads(part.read_text()))
    if res.get("first_token_mono") and res.get("start_mono") and "first_token_s" not in res:
        res["first_token_s"] = round(res["first_token_mono"] - res["start_mono"], 3)
    res.update(name=r.name, rc=rc, exit_mono=time.monotonic(), started_mono=r.started_mono,
               ember=reports.read(r.report))
    if r.requests_log.exists():  # the trickle, written as it went: there even if the engine died
        lines = r.requests_log.read_text().splitlines()
        res["requests"] = [json.loads(line) for line in lines if line.strip()]
    if rc != 0 or not res.get("first_token_mono"):
        res["log_tail"] = (r.run / "engine.log").read_text(errors="replace")[-6000:]
    typer.echo(f"{r.name}: rc={rc} first_token_s={res.get('first_token_s')}")
    return res


def stop(r: Running) -> None:
    """End the engine process and every process it started (vLLM's engine cores and workers),
    by its own session's id: nothing else on the machine."""
    if r.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, 15)
        try:
            r.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, 9)
            r.proc.wait()


def reap(r: Running) -> None:
    """Whatever the ended process left in its session (a vLLM worker that outlived its engine
    would hold its GPU memory into the next switch), killed by that session's id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(r.proc.pid, 9)


def switch(variant: str, new_ident: Any, p: Plan, work: Path, archive: str, opts: Options) -> dict[str, Any]:
    """Start the new shape (restored from `archive`, or native) while the old one serves."""
    child = {"role": "switch", "batch_sizes": list(opts.batch_sizes), "max_tokens": opts.max_tokens,
             "dp": p.new.data}
    args = engine_args_of(new_ident, opts.memory_fraction)
    # native-warm: the cache root the native start filled (ember_bench.vllm_parallel.child_env)
    cache = work / "runs" / "new-native" / "vllm-cache-native" if variant == "native-warm" else None
    t_switch = time.monotonic()
    r = spawn(f"new-{variant}", MODES[variant], args, p.new_gpus, work, child,
              archive if variant == "restored" else "", cache)
    try:
        first = first_token(r, opts.timeout)
    except BaseException:  # interrupted: the new engine does not outlive the bench
        stop(r)
        raise
    res = finish(r, opts.after_first_s if first else 30.0)
    res.update(variant=variant, switch_mono=t_switch,
               switch_to_first_token_s=round(first - t_switch, 3) if first else None)
    return res


def serve_old(old_ident: Any, p: Plan, work: Path, archive: str,
              opts: Options) -> tuple[Running, float | None]:
    """The old shape, restored, serving its trickle once its first token is out."""
    child = {"role": "serve", "interval_s": opts.interval_s, "trickle_tokens": opts.trickle_tokens,
             "request_timeout_s": opts.request_timeout_s, "stop": str(work / "runs" / "old.stop")}
    (work / "runs" / "old.stop").unlink(missing_ok=True)
    args = engine_args_of(old_ident, opts.memory_fraction)
    r = spawn("old", "load", args, p.old_gpus, work, child, archive)
    return r, first_token(r, opts.timeout)


def run_switches(p: Plan, work: Path, cfg: Path, variants: tuple[str, ...], opts: Options) -> dict[str, Any]:
    """SAVE both shapes, serve the old one, switch to the new one per variant; every result."""
    old_ident, new_ident = identity_of(cfg, p.old), identity_of(cfg, p.new)
    saves = {"old": save(old_ident, p, work / f"save-{p.old.name}", opts),
             "new": save(new_ident, p, work / f"save-{p.new.name}", opts)}
    out: dict[str, Any] = {"saves": saves, "identities": {"old": old_ident.hash(), "new": new_ident.hash()},
                           "switches": {}}
    old, ready = serve_old(old_ident, p, work, saves["old"]["archive"], opts)
    try:
        if ready is None:  # the new shape is still measured (GPU time is scarce); the report says
            stop(old)      # the old one never served, and its log's tail is under "old"
        time.sleep(opts.baseline_s)
        for variant in variants:
            out["switches"][variant] = switch(variant, new_ident, p, work, saves["new"]["archive"], opts)
            time.sleep(opts.settle_s)
    finally:
        (work / "runs" / "old.stop").touch()
        out["old"] = finish(old, opts.request_timeout_s + 60)
    return out


def gpu_count() -> int:
    """GPUs CUDA sees here (torch), else nvidia-smi's list, else 0."""
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
        return sum(1 for line in smi.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def bench_vllm_switch(
    model: Annotated[str, typer.Option(help="A shape of `ember bench vllm` (MoE for EP).")] = "qwen3-moe",
    layers: Annotated[int, typer.Option(help="Override the number of layers (0: the model's).")] = 4,
    from_tp: Annotated[int, typer.Option("--from-tp", help="Old shape: tensor-parallel ranks.")] = 1,
    from_ep: Annotated[int, typer.Option("--from-ep", help="Old shape: expert-parallel ranks "
                                         "(tensor x data; 1: no EP).")] = 2,
    to_tp: Annotated[int, typer.Option("--to-tp", help="New shape: tensor-parallel ranks.")] = 1,
    to_ep: Annotated[int, typer.Option("--to-ep", help="New shape: expert-parallel ranks.")] = 4,
    memory_fraction: Annotated[float, typer.Option(help="vLLM's --gpu-memory-utilization of EACH "
                                                   "engine: both must fit on a shared GPU.")] = 0.35,
    variants: Annotated[str, typer.Option(help="The new shape's starts, in order.")] = ",".join(VARIANTS),
    batch_sizes: Annotated[str, typer.Option(help="Greedy batch sizes of the new shape.")] = "1,4,16",
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 16,
    interval: Annotated[float, typer.Option(help="Seconds between the old shape's requests.")] = 0.25,
    baseline: Annotated[float, typer.Option(help="Seconds of serving before the first switch.")] = 10.0,
    reuse_saves: Annotated[bool, typer.Option(help="Keep an archive a previous run published.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds per SAVE / engine start.")] = 600.0,
    work: Annotated[Path, typer.Option(help="Configs, stores, caches, logs.")] = Path(
        "/tmp/ember-vllm-switch"),
    out_dir: Annotated[Path, typer.Option(help="Report folder.")] = Path("benchmarks/results"),
) -> None:
    """A parallelism switch on one machine: the old shape serving, the new one started beside it,
    restored vs native; switch → first token, the old shape's service meanwhile, tokens."""
    chosen = tuple(v for v in variants.split(",") if v)
    if why := variants_problem(chosen, VARIANTS):
        raise typer.BadParameter(f"--variants: {why}")
    try:
        old, new = shape(from_tp, from_ep), shape(to_tp, to_ep)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    p = plan(old, new, visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_count()), memory_fraction)
    opts = Options(model=model, layers=layers, memory_fraction=memory_fraction, max_tokens=max_tokens,
                   batch_sizes=tuple(int(b) for b in batch_sizes.split(",")), interval_s=interval,
                   baseline_s=baseline, timeout=timeout, reuse_saves=reuse_saves)
    if p.refusals:
        write_report(p, opts, {}, out_dir)
        raise typer.Exit(2)
    from ember_bench.vllm import write_config

    work = work.absolute() / f"{model}-{layers or 'all'}l-{old.name}-to-{new.name}"
    cfg = write_config(model, layers or None, work / "config")
    results = run_switches(p, work, cfg, chosen, opts)
    write_report(p, opts, results, out_dir)
