"""vLLM 0.26 on the GPU: SAVE inside a real engine, LOAD in a fresh process, tokens and captures.

A 2-layer random-weight Llama (V2 runner) and a 2-layer Qwen3-MoE (V1 runner) through
`ember bench vllm` (native → save → load): LOAD restores every graph, captures none at start or
while serving, and generates the native run's greedy tokens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),  # an engine start is 1-2 min; a test starts two to four
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen3-moe"])
def test_save_then_load_restores_every_graph(model: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()",
           "bench", "vllm", "--model", model, "--layers", "2", "--runs", "native,save,load",
           "--work", str(tmp_path), "--out-dir", str(tmp_path / "out"), "--batch-sizes", "1,5,12",
           "--gpu-memory-utilization", "0.4"]
    subprocess.run(cmd, check=True, timeout=900)
    report = json.loads(next((tmp_path / "out").glob("vllm-*.json")).read_text())
    runs = report["summary"]["runs"]
    assert runs["save"]["refusal"] is None, runs["save"]
    assert runs["load"]["refusal"] is None, runs["load"]
    assert runs["load"]["capture_how"] == "restored"
    assert runs["load"]["verify_ms"] is not None  # LOAD's canary ran, and the bench reports its cost
    assert runs["load"]["graphs_captured_at_start"] == 0
    assert runs["load"]["graphs_captured_serving"] == 0
    assert runs["load"]["tokens_identical_to_native"] is True
    assert report["summary"]["save"]["graphs"] == report["summary"]["load"]["graphs"] > 0


ENGINE = r"""
import json, sys
from vllm import SamplingParams
from vllm.compilation.counter import compilation_counter
from ember.engines.vllm.job import llm_from_cli
llm = llm_from_cli(json.loads(sys.argv[1]))
start = compilation_counter.num_cudagraph_captured
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
prompts = [{"prompt_token_ids": [11 + i, 12, 13 + 2 * i]} for i in range(5)]
outs = llm.generate(prompts, greedy, use_tqdm=False)
print("RESULT " + json.dumps({"captured_at_start": start,
                              "captured_serving": compilation_counter.num_cudagraph_captured - start,
                              "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def _engine(args: list[str], env: dict[str, str]) -> dict:
    p = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def vllm_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`ember save --job` for engine vllm, once for the module: probe, then SAVE under the identity
    the operator would derive (a 2-layer random Llama, 5 capture sizes)."""
    import os

    from ember.engines.vllm.job import save_job
    from ember.identity import ArchiveIdentity
    from ember_bench.vllm import write_config

    tmp = tmp_path_factory.mktemp("vllm-job")
    cfg = write_config("llama-3-8b", 2, tmp / "config")
    ident = ArchiveIdentity(model=str(cfg), engine="vllm", engine_version="0.26",
                            capture_sizes=(1, 2, 4, 8, 16), graph_mode="full-and-piecewise",
                            max_num_tokens=2048, max_batch=16)
    extra = ["--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.4",
             "--max-model-len", "2048", "--seed", "0"]
    store = tmp / "store"
    saved = dict(os.environ)
    os.environ.update(VLLM_CACHE_ROOT=str(tmp / "job-cache"), VLLM_USE_FLASHINFER_SAMPLER="0",
                      HF_HUB_OFFLINE="1")
    try:
        summary = save_job(ident.model_dump_json(), store.as_uri(), extra, work=tmp / "job")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"identity": ident, "extra": extra, "store": store, "summary": summary, "tmp": tmp}


def test_the_save_job_publishes_under_the_operators_identity_and_a_fresh_pod_restores(
    vllm_job: dict, tmp_path: Path
) -> None:
    """The Job's archive, then a pod's LOAD with an EMPTY compile cache: the archive's compile cache
    is put back, every graph restored, none captured, the native engine's greedy tokens."""
    import os

    from ember.archive import bundle
    from ember.engines.vllm import compile_cache
    from ember.engines.vllm.args import engine_args
    from ember.runtime.session import preload_env

    ident, store, summary = vllm_job["identity"], vllm_job["store"], vllm_job["summary"]
    assert summary["published"] is True and summary["identity"] == ident.hash()
    archive = bundle.open_archive(store, ident.hash())
    assert archive.manifest.attachments == ["attachment/" + compile_cache.NAME]
    assert archive.manifest.engine["compile_cache_key"]

    args = [*engine_args(ident), *vllm_job["extra"]]
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
    base.update(VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    native = _engine(args, {**base, "VLLM_CACHE_ROOT": str(tmp_path / "native-cache")})
    report = tmp_path / "load-report.json"
    load = _engine(args, {**preload_env("load", base), "VLLM_CACHE_ROOT": str(tmp_path / "pod-cache"),
                          "EMBER_VLLM_ARCHIVE": str(store / "archives" / ident.hash()),
                          "EMBER_VLLM_REPORT": str(report)})
    stages = json.loads(report.read_text())["stages"]
    assert stages["capture"]["how"] == "restored", stages
    assert stages["compile_cache"]["placed"] > 0
    assert load["captured_at_start"] == 0 and load["captured_serving"] == 0
    assert native["captured_at_start"] > 0
    assert load["tokens"] == native["tokens"]


def test_vllm_serve_restores_through_the_sidecar_handoff(vllm_job: dict, tmp_path: Path) -> None:
    """The pod's engine container as the operator builds it: `ember serve --engine vllm` waits for
    the hand-off (here written as the sidecar does, the archive fetched into its cache), then
    `vllm serve` with its engine core in its own process (vLLM's default) restores every graph
    with an empty compile cache, reports ready, and answers a completion."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    from ember import handoff
    from ember.engines.vllm.args import engine_args
    from ember.store import LocalStore
    from ember_sidecar.fetching import ArchiveCache

    ident, store = vllm_job["identity"], vllm_job["store"]
    w = handoff.HandoffWriter(tmp_path / "run")
    # the sidecar's copy
    ArchiveCache(w.cache_dir).fetch(LocalStore(store).manifest_uri(ident.hash()), ident.hash())
    w.ready(ident.hash(), w.archive_dir(ident.hash()),
            engine_args=(*engine_args(ident), *vllm_job["extra"]))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "LD_PRELOAD"))}
    env.update(VLLM_CACHE_ROOT=str(tmp_path / "pod-cache"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()",
           "serve", "--engine", "vllm", "--run-dir", str(w.run_dir), "--", "--host", "127.0.0.1",
           "--port", str(port)]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready, end = None, time.monotonic() + 540
        while ready is None and time.monotonic() < end and proc.poll() is None:
            ready = next((r for r in w.new_reports() if r["stage"] == "ready"), None)
            time.sleep(0.5)
        tail = (tmp_path / "serve.log").read_text()[-4000:]
        assert ready is not None, tail
        stages = ready["vllm"]["stages"]
        assert ready["restored"] is True and stages["capture"]["how"] == "restored", (stages, tail)
        assert stages["compile_cache"]["placed"] > 0
        body = json.dumps({"model": str(ident.model), "prompt": [11, 12, 13], "max_tokens": 4,
                           "temperature": 0, "ignore_eos": True}).encode()  # random weights may end early
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
