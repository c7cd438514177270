"""`ember bench vllm-warm`: vLLM warm pods on one GPU — claim → first token of a warm pod in both
warm modes (`warmPool.engine` ready and sleeping), the GPU memory a warm pod holds while idle, next
to the cold starts (restored and native). One command on a GPU machine with vLLM installed.

The deployments are the operator's: a `ModelDeploymentSpec` per mode (random weights of a real
model shape, `--load-format dummy --skip-tokenizer-init`) gives the archive identity, the SAVE
Job's arguments and the claim's engine arguments exactly as the operator derives them (sleeping
adds `--enable-sleep-mode`: its own archive). Then, each in a fresh process with an empty vLLM
cache, through the pod's own engine command (`ember serve --engine vllm`) behind a hand-off
written as the sidecar writes it (the archive in the local store):

1. `save-ready`, `save-sleeping`: the SAVE Job (`ember.engines.vllm.job.save_job`: probe, SAVE);
2. `cold-native`: a claimed pod told to capture natively; `cold-restored`: a claimed pod with the
   archive. The claim is the process start (a cold pod is created claimed); claim → first token
   is until the first completion after the pod reported `ready` (when its readiness passes);
3. `warm-ready`, `warm-sleeping`: a warm pod (hand-off before any claim, EMBER_WARM_ENGINE set);
   once its engine says `ready` (after ember's warm-up token, and the sleep), `--idle` seconds of
   idling, then the GPU memory of the pod's own processes (nvidia-smi per process, blind to other
   users of the GPU) and the GPU's rise over its use before the pod (median of a few samples
   each); then the claim (the hand-off turns in service, as the sidecar does) and at
   once a completion (max_tokens 1), retried while refused: claim → first token. The sidecar's watch
   latency and the Service's routing are not in it.

After the first token each run generates greedy tokens (compared with cold-native's: a woken
engine must compute what a fresh one does) and samples the memory serving. Report:
`benchmarks/results/vllm-warm-<gpu>-<model>.{json,md}` (ember_bench.vllm_warm_report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract, handoff
from ember.engines.vllm.compile_cache import TRITON_HOME
from ember.identity import ArchiveIdentity
from ember_bench import pods
from ember_bench.vllm import SHAPES, write_config
from ember_bench.vllm_warm_report import RUNS, earlier, write_report
from ember_bench.warm_report import go_on_from as go_on

MODES = (contract.WARM_ENGINE_READY, contract.WARM_ENGINE_SLEEPING)


@dataclass(frozen=True)
class Options:
    model: str = "llama-3-8b"
    layers: int = 0
    work: Path = Path("/tmp/ember-vllm-warm")
    out_dir: Path = Path("benchmarks/results")
    runs: tuple[str, ...] = RUNS
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 2048
    graph_mode: str = "full-and-piecewise"
    max_batch: int = 128
    max_num_tokens: int = 8192
    idle_s: float = 10.0
    gpu: str = ""  # nvidia-smi -i: index or UUID; "" → CUDA_VISIBLE_DEVICES' first, else 0
    timeout: float = 900.0
    fresh: bool = False  # start over: no archive of the store, no run of an earlier report

    @property
    def tag(self) -> str:
        return self.model + (f"-{self.layers}l" if self.layers else "")


@dataclass(frozen=True)
class Deployment:
    """One warm mode's ModelDeployment as the operator derives it."""

    mode: str
    identity: ArchiveIdentity
    save_args: list[str]  # the SAVE Job's engine arguments (GraphArchive spec.save.args)
    claim_args: tuple[str, ...]  # the claim's (ember.dev/engine-args): identity's, then the deployment's


def deployment(cfg: Path, mode: str, o: Options, vllm_version: str) -> Deployment:
    from ember_operator.api import ModelDeploymentSpec
    from ember_operator.planning import engine_args

    base = ["--load-format", "dummy", "--skip-tokenizer-init", "--seed", "0", "--gpu-memory-utilization",
            str(o.gpu_memory_utilization), "--max-model-len", str(o.max_model_len)]
    spec = ModelDeploymentSpec.model_validate({
        "model": {"name": str(cfg)},
        "engine": {"kind": "vllm", "version": vllm_version, "image": "ember-bench", "args": base},
        "capture": {"graphMode": o.graph_mode, "maxBatch": o.max_batch, "maxNumTokens": o.max_num_tokens},
        "gpu": {"product": "ember-bench"},
        "warmPool": {"size": 1, "engine": mode},
    })
    ident = spec.identity()
    return Deployment(mode, ident, spec.engine_run_args(), engine_args(spec, ident))


# ---------------------------------------------------------------------------------------------
# SAVE and pods
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def save(d: Deployment, store: Path, o: Options) -> dict[str, Any]:
    """The SAVE Job of the deployment (probe, then SAVE); its summary or the error. An archive of
    the identity already in the store (an earlier invocation's) is used as it is."""
    from ember.engines.vllm.job import JobFailed, save_job

    if (store / "archives" / d.identity.hash() / "manifest").is_file():
        typer.echo(f"save-{d.mode}: {d.identity.hash()[:16]} in the store already")
        return {"identity": d.identity.hash(), "published": True, "reused": True}
    work = o.work / f"job-{d.mode}"
    shutil.rmtree(work, ignore_errors=True)
    typer.echo(f"save-{d.mode}: {d.identity.hash()[:16]} args {d.save_args}")
    with _environ(VLLM_CACHE_ROOT=str(work / "vllm-cache"), VLLM_USE_FLASHINFER_SAMPLER="0",
                  HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1"):
        try:
            return save_job(d.identity.model_dump_json(), store.as_uri(), d.save_args, work=work,
                            timeout=o.timeout)
        except JobFailed as exc:
            return {"error": str(exc)}


def _hand_off(w: handoff.HandoffWriter, run: str, d: Deployment, store: Path, claimed_at: float) -> None:
    h = d.identity.hash()
    pods.hand_off(w, run, h, store / "archives" / h, d.claim_args, claimed_at)


def _pod_env(run: str, d: Deployment, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD"))}
    env.update(VLLM_CACHE_ROOT=str(cache), TRITON_HOME=str(cache / TRITON_HOME), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    if run.startswith("warm-"):
        env[contract.ENV_WARM_ENGINE] = d.mode
    return env


def run_pod(run: str, d: Deployment, store: Path, o: Options, index: str) -> dict[str, Any]:
    """One pod's engine container (`ember serve --engine vllm`) from hand-off to serving; its figures."""
    run_dir, cache = o.work / f"pod-{run}", o.work / f"pod-{run}-vllm-cache"
    shutil.rmtree(run_dir, ignore_errors=True)
    if run == "cold-native-warm-cache":
        cache = o.work / "pod-cold-native-vllm-cache"
        if not cache.is_dir():
            return {"run": run, "mode": d.mode, "identity": d.identity.hash(),
                    "error": "no vLLM cache of a cold-native run to start from: run cold-native first"}
    else:
        shutil.rmtree(cache, ignore_errors=True)
    w, port = handoff.HandoffWriter(run_dir), pods.free_port()
    res: dict[str, Any] = {"run": run, "mode": d.mode, "identity": d.identity.hash(),
                           "gpu_before_mib": pods.gpu_used_mib(index)}
    cmd = pods.ember_argv("serve", "--engine", "vllm", "--run-dir", str(run_dir), "--", "--host", "127.0.0.1",
                          "--port", str(port))
    started = time.time()
    _hand_off(w, run, d, store, started)

    def body(proc: subprocess.Popen[bytes]) -> None:
        if run.startswith("warm-"):
            pods.warm(w, proc, port, started, res, o.timeout, o.idle_s, index)
        else:
            pods.cold(w, proc, port, started, res, o.timeout, index)

    pods.drive(cmd, _pod_env(run, d, cache), o.work / f"pod-{run}.log", body, res, index)
    typer.echo(f"{run}: claim → first token {res.get('claim_to_first_token_s')} s, "
               f"idle {res.get('gpu_idle_mib')} MiB, error {res.get('error')}")
    return res


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def run_bench(o: Options) -> tuple[Path, Path]:
    from importlib.metadata import version

    unknown = [r for r in o.runs if r not in RUNS]
    if unknown:
        raise typer.BadParameter(f"unknown runs {unknown}: {', '.join(RUNS)}")
    work = o.work.absolute() / o.tag
    o = dataclasses.replace(o, work=work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = write_config(o.model, o.layers or None, work / "config")
    store, index = work / "store", pods.gpu_index(o.gpu)
    gpu = pods.gpu_facts(index)
    deps = {m: deployment(cfg, m, o, version("vllm")) for m in MODES}
    if o.fresh:
        shutil.rmtree(store, ignore_errors=True)
    results, saves = ({}, {}) if o.fresh else go_on_from(o, gpu, deps)
    for run in o.runs:
        mode = contract.WARM_ENGINE_SLEEPING if run == "warm-sleeping" else contract.WARM_ENGINE_READY
        if not run.startswith("cold-native") and mode not in saves:
            saves[mode] = save(deps[mode], store, o)
        if saves.get(mode, {}).get("error"):
            results[run] = {"run": run, "mode": mode, "error": f"no archive: {saves[mode]['error']}"}
        else:
            results[run] = run_pod(run, deps[mode], store, o, index)
        write_report(o.tag, results, saves, gpu, o.out_dir)  # a cut-off run still leaves its figures
    return write_report(o.tag, results, saves, gpu, o.out_dir)


def go_on_from(o: Options, gpu: dict[str, Any], deps: dict[str, Deployment]
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The runs and SAVEs of an earlier invocation's report (this GPU and model) of the same
    deployments, so that the runs can be split over several commands; this one's runs replace them."""
    ids = {m: d.identity.hash() for m, d in deps.items()}
    kept, saves = go_on(earlier(o.tag, gpu, o.out_dir), ids, o.runs, o.work / "store")
    if kept:
        typer.echo(f"going on from {', '.join(kept)} of the earlier report (--fresh: start over)")
    return kept, saves


# long: typer declares every option in the signature; the body is one call
def bench_vllm_warm(
    model: Annotated[str, typer.Option(help=f"One of {', '.join(SHAPES)}.")] = "llama-3-8b",
    layers: Annotated[int, typer.Option(help="Override the number of layers (0: the model's).")] = 0,
    work: Annotated[Path, typer.Option(help="Configs, store, vLLM caches, logs.")] = Options.work,
    out_dir: Annotated[Path, typer.Option(help="Report folder.")] = Path("benchmarks/results"),
    runs: Annotated[str, typer.Option(help="Which runs, in order.")] = ",".join(RUNS),
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's memory fraction.")] = 0.85,
    max_model_len: Annotated[int, typer.Option(help="vLLM's --max-model-len.")] = 2048,
    graph_mode: Annotated[str, typer.Option(help="capture.graphMode.")] = "full-and-piecewise",
    max_batch: Annotated[int, typer.Option(help="capture.maxBatch (default preset sizes up to it).")] = 128,
    max_num_tokens: Annotated[int, typer.Option(help="capture.maxNumTokens.")] = 8192,
    idle: Annotated[float, typer.Option(help="Seconds a warm pod idles before its memory is read.")] = 10.0,
    gpu: Annotated[str, typer.Option(help="nvidia-smi -i (index or UUID); default: CUDA_VISIBLE_DEVICES'"
                                          " first, else 0.")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds per SAVE and per pod start.")] = 900.0,
    fresh: Annotated[bool, typer.Option(help="Start over: SAVE again, forget an earlier report's runs "
                                             "(default: go on from them, runs given here replace theirs).")
                     ] = False,
) -> None:
    """vLLM warm pods: claim → first token (ready and sleeping), idle GPU memory, cold starts (GPU)."""
    chosen = tuple(r.strip() for r in runs.split(",") if r.strip())
    js, md = run_bench(Options(model, layers, work, out_dir, chosen, gpu_memory_utilization, max_model_len,
                               graph_mode, max_batch, max_num_tokens, idle, gpu, timeout, fresh))
    typer.echo(md.read_text())
    typer.echo(f"wrote {js} and {md}")
