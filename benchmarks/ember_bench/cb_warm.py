"""`ember bench cb-warm`: warm pods of transformers' continuous-batching engine (`ember serve`) —
claim → first token of a warm pod, the GPU memory it holds while idle, next to the cold starts
(restored and native). One command on a GPU machine with torch, transformers and libember.

The deployment is the operator's: a `ModelDeploymentSpec` of `engine.kind: transformers` (a
built-in shape with random weights, `--layers` to cut it, or `--model-config FILE`) gives the
archive identity, the SAVE Job's engine arguments and the pods' `ember serve` arguments
(`ember.contract.serve_args`, which the claim carries too) exactly as the operator derives them.
Then, each in a fresh process, through the pod's own engine command (`ember serve --run-dir DIR
--host 127.0.0.1 --port P <serve args>`) behind a hand-off written as the sidecar writes it (the
archive in the local store):

1. `save`: the SAVE Job (`ember save --job -- <engine.args>` with the operator's environment:
   EMBER_IDENTITY, EMBER_IDENTITY_HASH, EMBER_STORE), skipped when the store has the archive;
2. `cold-native`: a claimed pod told to capture natively; `cold-restored`: a claimed pod with the
   archive. The claim is the process start (a cold pod is created claimed); claim → first token
   is until the first completion after the pod reported `ready` (when its readiness passes);
3. `warm-ready`: a warm pod (the archive handed off before any claim: it restores, runs one token
   and says its engine is `ready`); `--idle` seconds of idling, then the GPU memory of the pod's
   own processes (nvidia-smi per process, blind to other users of the GPU) and the GPU's rise over
   its use before the pod (median of a few samples each); then the claim
   (the hand-off turns in service, as the sidecar does) and at once a completion (max_tokens 1),
   retried while refused: claim → first token. The sidecar's watch latency and the Service's
   routing are not in it. transformers has no sleeping engine: `warm-sleeping` is refused.

After the first token each run reads `ember serve`'s /health (restored or native, its stages),
generates 16 greedy tokens (compared with cold-native's) and samples the memory serving. Report:
`benchmarks/results/cb-warm-<gpu>-<model>.{json,md}` (ember_bench.cb_warm_report).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract, handoff
from ember.identity import ArchiveIdentity, canonical_json
from ember_bench import pods, warm_report
from ember_bench.cb_warm_report import BENCH, RUNS, write_report

MODE = contract.WARM_ENGINE_READY  # the only warm engine of transformers
POD_ENV = {"NCCL_CUMEM_ENABLE": "0", contract.ENV_ENGINE: "transformers"}  # the operator's, and SAVE's


@dataclass(frozen=True)
class Options:
    model: str = "llama-3-8b"
    layers: int = 0
    model_config: Path | None = None  # a transformers config JSON instead of a built-in shape
    serve_args: tuple[str, ...] = ()  # more `ember serve` options (engine.args): sizing …
    work: Path = Path("/tmp/ember-cb-warm")
    out_dir: Path = Path("benchmarks/results")
    runs: tuple[str, ...] = RUNS
    idle_s: float = 10.0
    gpu: str = ""  # nvidia-smi -i: index or UUID; "" → CUDA_VISIBLE_DEVICES' first, else 0
    timeout: float = 900.0
    fresh: bool = False  # start over: no archive of the store, no run of an earlier report

    @property
    def name(self) -> str:
        """The deployment's model.name (a config file's stem)."""
        return self.model_config.stem if self.model_config is not None else self.model

    @property
    def tag(self) -> str:
        return self.name + (f"-{self.layers}l" if self.layers else "")

    def engine_args(self) -> list[str]:
        """The deployment's engine.args: `ember serve` options after the model."""
        config = ["--model-config", str(self.model_config)] if self.model_config is not None else []
        return [*config, *(["--layers", str(self.layers)] if self.layers else []), *self.serve_args]


@dataclass(frozen=True)
class Deployment:
    """The ModelDeployment as the operator derives it."""

    identity: ArchiveIdentity
    save_args: list[str]  # the SAVE Job's engine arguments (after `ember save --job --`)
    serve_args: tuple[str, ...]  # the pods' `ember serve` arguments, and the claim's engine arguments
    mode: str = MODE


def deployment(o: Options, transformers_version: str) -> Deployment:
    from ember_operator.api import ModelDeploymentSpec
    from ember_operator.planning import engine_args

    spec = ModelDeploymentSpec.model_validate({
        "model": {"name": o.name},
        "engine": {"kind": "transformers", "version": transformers_version, "image": "ember-bench",
                   "args": o.engine_args()},
        "gpu": {"product": "ember-bench"},
        "warmPool": {"size": 1, "engine": MODE},
    })
    ident = spec.identity()
    return Deployment(ident, spec.engine_run_args(), engine_args(spec, ident))


def _env(**values: str) -> dict[str, str]:
    """This environment without libember and ember's variables (each process sets its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD"))}
    return {**env, **POD_ENV, "PYTHONUNBUFFERED": "1", **values}


def save(d: Deployment, store: Path, o: Options) -> dict[str, Any]:
    """The SAVE Job of the deployment; its summary or the error. An archive of the identity
    already in the store (an earlier invocation's) is used as it is."""
    h = d.identity.hash()
    if (store / "archives" / h / "manifest").is_file():
        typer.echo(f"save: {h[:16]} in the store already")
        return {"identity": h, "published": True, "reused": True}
    log = o.work / "save-termination-log"
    log.unlink(missing_ok=True)
    typer.echo(f"save: {h[:16]} args {d.save_args}")
    env = _env(**{contract.ENV_IDENTITY: canonical_json(d.identity.canonical()).decode(),
                  contract.ENV_IDENTITY_HASH: h, contract.ENV_STORE: store.as_uri(),
                  contract.ENV_TERMINATION_LOG: str(log)})
    t = time.monotonic()
    try:
        proc = subprocess.run(pods.ember_argv("save", "--job", "--", *d.save_args), env=env,
                              capture_output=True, text=True, timeout=o.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"identity": h, "error": f"the SAVE Job ran past {o.timeout:.0f} s"}
    reason = log.read_text() if log.is_file() else ""
    if proc.returncode != 0:
        return {"identity": h, "error": reason or f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    try:
        summary = json.loads(reason)
    except ValueError:
        return {"identity": h, "error": f"no summary in the termination log: {reason[:500]!r}"}
    return {**summary, "identity": h, "seconds": round(time.monotonic() - t, 1)}


def describe(port: int, res: dict[str, Any]) -> None:
    """`ember serve`'s /health once serving: restored or native, why, its stages; its `ready`
    report's seconds are claim → ready (the first token inside the engine, from the claim)."""
    _, health = pods.get(port, "/health")
    res["health"] = health
    res["restored"] = health.get("mode") == "restored"
    res["stages"] = health.get("stages")
    res["claim_to_ready_s"] = (res.get("ready_report") or {}).get("seconds")


def run_pod(run: str, d: Deployment, store: Path, o: Options, index: str) -> dict[str, Any]:
    """One pod's engine container (`ember serve <serve args>`) from hand-off to serving; its figures."""
    run_dir = o.work / f"pod-{run}"
    shutil.rmtree(run_dir, ignore_errors=True)
    w, port, h = handoff.HandoffWriter(run_dir), pods.free_port(), d.identity.hash()
    res: dict[str, Any] = {"run": run, "mode": d.mode, "identity": h,
                           "gpu_before_mib": pods.gpu_used_mib(index)}
    cmd = pods.ember_argv("serve", "--run-dir", str(run_dir), "--host", "127.0.0.1", "--port", str(port),
                          *d.serve_args)
    env = _env(**({contract.ENV_WARM_ENGINE: d.mode} if run.startswith("warm-") else {}))
    started = time.time()
    pods.hand_off(w, run, h, store / "archives" / h, d.serve_args, started)

    def body(proc: subprocess.Popen[bytes]) -> None:
        if run.startswith("warm-"):
            pods.warm(w, proc, port, started, res, o.timeout, o.idle_s, index, describe)
        else:
            pods.cold(w, proc, port, started, res, o.timeout, index, describe)

    pods.drive(cmd, env, o.work / f"pod-{run}.log", body, res, index)
    typer.echo(f"{run}: claim → first token {res.get('claim_to_first_token_s')} s, restored "
               f"{res.get('restored')}, idle {res.get('gpu_idle_mib')} MiB, error {res.get('error')}")
    return res


def check_runs(runs: tuple[str, ...]) -> None:
    if "warm-sleeping" in runs:
        raise typer.BadParameter("warm-sleeping: transformers has no sleeping engine (vLLM only: "
                                 "`ember bench vllm-warm`)")
    if unknown := [r for r in runs if r not in RUNS]:
        raise typer.BadParameter(f"unknown runs {unknown}: {', '.join(RUNS)}")


def run_bench(o: Options) -> tuple[Path, Path]:
    from importlib.metadata import version

    check_runs(o.runs)
    work = o.work.absolute() / o.tag
    o = dataclasses.replace(o, work=work)
    work.mkdir(parents=True, exist_ok=True)
    store, index = work / "store", pods.gpu_index(o.gpu)
    gpu = pods.gpu_facts(index)
    d = deployment(o, version("transformers"))
    if o.fresh:
        shutil.rmtree(store, ignore_errors=True)
    results, saves = ({}, {}) if o.fresh else warm_report.go_on_from(
        warm_report.earlier(BENCH, o.tag, gpu, o.out_dir), {MODE: d.identity.hash()}, o.runs, store)
    if results:
        typer.echo(f"going on from {', '.join(results)} of the earlier report (--fresh: start over)")
    for run in o.runs:
        if run != "cold-native" and MODE not in saves:
            saves[MODE] = save(d, store, o)
        if run != "cold-native" and saves[MODE].get("error"):
            results[run] = {"run": run, "mode": MODE, "identity": d.identity.hash(),
                            "error": f"no archive: {saves[MODE]['error']}"}
        else:
            results[run] = run_pod(run, d, store, o, index)
        write_report(o.tag, results, saves, gpu, o.out_dir)  # a cut-off run still leaves its figures
    return write_report(o.tag, results, saves, gpu, o.out_dir)


# long: typer declares every option in the signature; the body is one call
def bench_cb_warm(
    model: Annotated[str, typer.Option(help="Built-in shape: llama-3-8b, qwen3-8b, tiny-llama.")
                     ] = "llama-3-8b",
    layers: Annotated[int, typer.Option(help="Override the number of layers (0: the model's).")] = 0,
    model_config: Annotated[Path | None, typer.Option(help="A transformers config JSON instead of "
                                                           "--model (random weights).")] = None,
    serve_args: Annotated[str, typer.Option(help="More `ember serve` options of the deployment "
                                                 "(engine.args), e.g. '--num-blocks 128'.")] = "",
    work: Annotated[Path, typer.Option(help="Store, logs, run dirs.")] = Options.work,
    out_dir: Annotated[Path, typer.Option(help="Report folder.")] = Path("benchmarks/results"),
    runs: Annotated[str, typer.Option(help="Which runs, in order.")] = ",".join(RUNS),
    idle: Annotated[float, typer.Option(help="Seconds a warm pod idles before its memory is read.")] = 10.0,
    gpu: Annotated[str, typer.Option(help="nvidia-smi -i (index or UUID); default: CUDA_VISIBLE_DEVICES'"
                                          " first, else 0.")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds of the SAVE and per pod start.")] = 900.0,
    fresh: Annotated[bool, typer.Option(help="Start over: SAVE again, forget an earlier report's runs "
                                             "(default: go on from them, runs given here replace theirs).")
                     ] = False,
) -> None:
    """transformers continuous-batching warm pods: claim → first token, idle GPU memory, cold starts (GPU)."""
    chosen = tuple(r.strip() for r in runs.split(",") if r.strip())
    js, md = run_bench(Options(model, layers, model_config, tuple(shlex.split(serve_args)), work, out_dir,
                               chosen, idle, gpu, timeout, fresh))
    typer.echo(md.read_text())
    typer.echo(f"wrote {js} and {md}")
