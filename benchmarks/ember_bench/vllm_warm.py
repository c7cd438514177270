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
   idling, then nvidia-smi's memory.used of the GPU (median of a few samples; the GPU's use before
   the pod is subtracted); then the claim (the hand-off turns in service, as the sidecar does) and at
   once a completion (max_tokens 1), retried while refused: claim → first token. The sidecar's watch
   latency and the Service's routing are not in it.

After the first token each run generates greedy tokens (compared with cold-native's: a woken
engine must compute what a fresh one does) and samples the memory serving. Report:
`benchmarks/results/vllm-warm-<gpu>-<model>.{json,md}` (ember_bench.vllm_warm_report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract, handoff
from ember.identity import ArchiveIdentity
from ember_bench.vllm import SHAPES, write_config
from ember_bench.vllm_warm_report import RUNS, earlier, parse_smi, write_report

PROMPT = list(range(101, 133))  # token ids (no tokenizer): the client's first request
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
# GPU memory and HTTP
# ---------------------------------------------------------------------------------------------


def gpu_index(given: str = "") -> str:
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    return given or first or "0"


def gpu_used_mib(index: str) -> int | None:
    """memory.used of the GPU, from outside every process (nvidia-smi); None when unreadable."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = parse_smi(out.stdout)
    return used[0] if used else None


def gpu_facts(index: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=20, check=False)
        name, total = out.stdout.strip().splitlines()[0].rsplit(",", 1)
        return {"index": index, "name": name.strip(), "total_mib": int(total)}
    return {"index": index, "name": "unknown"}


def samples(index: str, n: int = 5, every_s: float = 0.5) -> list[int]:
    out = []
    for i in range(n):
        if i:
            time.sleep(every_s)
        if (used := gpu_used_mib(index)) is not None:
            out.append(used)
    return out


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return int(exc.code), {"error": exc.read()[:500].decode(errors="replace")}


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def first_token(port: int, model: str, timeout: float, proc: subprocess.Popen[bytes] | None = None
                ) -> tuple[float, int]:
    """One completion (max_tokens 1), retried while refused or unreachable (and `proc` lives): (the
    wall time it came back, the refusals before it)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    refusals, end = 0, time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"ember serve exited {proc.returncode} before the first token "
                               f"({refusals} refusals)")
        try:
            status, _ = _post(port, "/v1/completions", body, timeout)
        except OSError:
            status = 0
        if status == 200:
            return time.time(), refusals
        refusals += 1
        time.sleep(0.01)
    raise TimeoutError(f"no first token within {timeout:.0f} s ({refusals} refusals)")


def greedy(port: int, model: str) -> tuple[list[Any] | None, str]:
    """16 greedy token ids (vLLM's `token_ids`, else its logprobs' tokens as `token_id:N`; without a
    tokenizer the text says nothing), or None and why."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    status, out = _post(port, "/v1/completions", body)
    if status != 200:
        return None, f"HTTP {status}: {out}"
    choice = (out.get("choices") or [{}])[0]
    ids = choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens")
    return (list(ids), "") if ids else (None, f"no token ids in {str(choice)[:300]}")


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hand_off(w: handoff.HandoffWriter, run: str, d: Deployment, store: Path, claimed_at: float) -> None:
    """What the sidecar writes: a claimed pod's archive (or capture natively), or a warm pod's."""
    h = d.identity.hash()
    w.warm = run.startswith("warm-")
    w.fetching(h, "", claimed_at=claimed_at)
    if run.startswith("cold-native"):
        w.fallback("bench: cold native start", identity=h, engine_args=d.claim_args)
    else:
        w.ready(h, store / "archives" / h, engine_args=d.claim_args)


def _pod_env(run: str, d: Deployment, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD"))}
    env.update(VLLM_CACHE_ROOT=str(cache), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    if run.startswith("warm-"):
        env[contract.ENV_WARM_ENGINE] = d.mode
    return env


def _wait(pred: Any, proc: subprocess.Popen[bytes], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := pred()) is not None:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited {proc.returncode} before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def _engine_settled(run_dir: Path) -> dict[str, Any] | None:
    """The engine state once ready or failed, else None."""
    state = handoff.read_engine_state(run_dir) or {}
    return state if state.get("state") in (contract.ENGINE_READY, contract.ENGINE_FAILED) else None


def _ready_report(w: handoff.HandoffWriter, seen: list[dict[str, Any]]) -> dict[str, Any] | None:
    seen.extend(w.new_reports())
    return next((r for r in seen if r.get("stage") == "ready"), None)


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
    w, port = handoff.HandoffWriter(run_dir), _free_port()
    res: dict[str, Any] = {"run": run, "mode": d.mode, "identity": d.identity.hash(),
                           "gpu_before_mib": gpu_used_mib(index)}
    cmd = [sys.executable, "-c", "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()",
           "serve", "--engine", "vllm", "--run-dir", str(run_dir), "--", "--host", "127.0.0.1",
           "--port", str(port)]
    started = time.time()
    _hand_off(w, run, d, store, started)
    log = open(o.work / f"pod-{run}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=_pod_env(run, d, cache), stdout=log, stderr=subprocess.STDOUT)
    try:
        (_warm if run.startswith("warm-") else _cold)(w, proc, port, started, res, o, index)
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            res["exit_code"] = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            res["exit_code"] = proc.wait()
        log.close()
    if "error" in res:
        res["log_tail"] = (o.work / f"pod-{run}.log").read_text(errors="replace")[-6000:]
    res["gpu_after_exit_mib"] = gpu_used_mib(index)
    typer.echo(f"{run}: claim → first token {res.get('claim_to_first_token_s')} s, "
               f"idle {res.get('gpu_idle_mib')} MiB, error {res.get('error')}")
    return res


def _cold(w: handoff.HandoffWriter, proc: subprocess.Popen[bytes], port: int, claimed: float,
          res: dict[str, Any], o: Options, index: str) -> None:
    """A claimed pod: ready (its readiness passes), then the first request; the claim was the start."""
    seen: list[dict[str, Any]] = []
    res["ready_report"] = _wait(lambda: _ready_report(w, seen), proc, o.timeout, "the ready report")
    res["start_to_ready_s"] = round(time.time() - claimed, 3)
    model = served_model(port)
    done, res["first_token_refusals"] = first_token(port, model, o.timeout, proc)
    res["claim_to_first_token_s"] = round(done - claimed, 3)
    _serving(port, model, res, index)


def _warm(w: handoff.HandoffWriter, proc: subprocess.Popen[bytes], port: int, started: float,
          res: dict[str, Any], o: Options, index: str) -> None:
    """A warm pod: engine ready, idle, memory; the claim and at once the first request."""
    state = _wait(lambda: _engine_settled(w.run_dir), proc, o.timeout, "the engine's ready state")
    if state["state"] == contract.ENGINE_FAILED:
        raise RuntimeError(f"engine failed: {state.get('reason')}")
    res["start_to_ready_s"] = round(float(state["at"]) - started, 3)
    res["engine_state"] = state
    model = served_model(port)  # the client knows its model: not part of the claim's time
    time.sleep(o.idle_s)
    res["gpu_idle_mib"] = samples(index)
    seen: list[dict[str, Any]] = []
    claimed = time.time()
    w.in_service(claimed)  # the sidecar's part of the claim
    done, res["first_token_refusals"] = first_token(port, model, o.timeout, proc)
    res["claim_to_first_token_s"] = round(done - claimed, 4)
    res["ready_report"] = _wait(lambda: _ready_report(w, seen), proc, 60.0, "the ready report")
    _serving(port, model, res, index)


def _serving(port: int, model: str, res: dict[str, Any], index: str) -> None:
    res["tokens"], why = greedy(port, model)
    if why:
        res["tokens_error"] = why
    res["gpu_serving_mib"] = samples(index, n=3)


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
    store, index = work / "store", gpu_index(o.gpu)
    gpu = gpu_facts(index)
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
    results, saves = earlier(o.tag, gpu, o.out_dir)
    ids = {m: d.identity.hash() for m, d in deps.items()}
    kept = {r: res for r, res in results.items() if res.get("identity") == ids.get(res.get("mode", ""))
            and r not in o.runs}
    if kept:
        typer.echo(f"going on from {', '.join(kept)} of the earlier report (--fresh: start over)")
    store = o.work / "store" / "archives"  # an earlier SAVE counts while its archive is still there
    return kept, {m: s for m, s in saves.items()
                  if s.get("identity") == ids.get(m) and (store / ids[m] / "manifest").is_file()}


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
