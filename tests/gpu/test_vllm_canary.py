"""LOAD's canary for vLLM 0.26 on the GPU (`ember.engines.vllm.canary`): a clean restore passes
it and serves native's greedy tokens; an injected fault is refused before any request and the
engine then captures natively and serves the same tokens.

One GPU: a 2-layer random Llama-3-8B shape (vLLM's V2 runner) and a 2-layer Qwen3-MoE shape (V1),
each SAVEd once by the SAVE Job; the canary compares the restored steps with SAVE's fingerprints
of the native ones. Two GPUs (TP=2, the Llama shape): ONE single-GPU SAVE, a 2-rank LOAD; the
canary compares each rank's restored PIECEWISE step with the same step run without graphs, and a
wrong splice (`splice-redop`) is refused on both ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(2400),  # a SAVE Job and a native start per module, then one start per test
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

EXTRA = ["--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.4",
         "--max-model-len", "2048", "--seed", "0"]
ENGINE = r"""
import json, sys
from vllm import SamplingParams
from vllm.compilation.counter import compilation_counter
from ember.engines.vllm.job import llm_from_cli
llm = llm_from_cli(json.loads(sys.argv[1]))
start = compilation_counter.num_cudagraph_captured
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
prompts = [{"prompt_token_ids": [11 + i, 12, 13 + 2 * i, 40 + i]} for i in range(5)]
outs = llm.generate(prompts, greedy, use_tqdm=False)
print("RESULT " + json.dumps({"captured_at_start": start,
                              "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
"""
CANARY = "canary differs"


def _gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except ImportError:
        return 0


def _identity(model: str, cfg: Path, tensor: int = 1) -> Any:
    from ember.identity import ArchiveIdentity, Parallelism

    return ArchiveIdentity(model=str(cfg), engine="vllm", engine_version="0.26",
                           capture_sizes=(1, 2, 4, 8, 16), graph_mode="full-and-piecewise",
                           max_num_tokens=2048, max_batch=16, parallelism=Parallelism(tensor=tensor))


def _env(mode: str, args: list[str], cache: Path, extra: dict[str, str]) -> dict[str, str]:
    from ember.engines.vllm.args import process_env
    from ember.engines.vllm.ranks import pod_env

    env = process_env(mode, {**os.environ, **pod_env(args)})
    env.update(VLLM_CACHE_ROOT=str(cache), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1", **extra)
    return env


# vLLM refuses a start whose memory profiling sees another process free GPU memory, such as a test
# lane beside it on the same GPU whose engine exits then (benchmarks/results/h200-20261201d)
PROFILING_CLASH = "Error in memory profiling"


def _engine(args: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    from ember_bench.vllm import run_session

    # its own session, killed with its workers past the limit (one stuck in a collective held its GPU)
    limit = float(os.environ.get("EMBER_GPU_ENGINE_TIMEOUT_S", "900"))
    for tries_left in (1, 0):  # a start that met a profiling clash is started once more
        rc = run_session([sys.executable, "-c", ENGINE, json.dumps(args)], env, log, limit)
        text = log.read_text()
        if rc == 0 or PROFILING_CLASH not in text or not tries_left:
            break
        log.rename(log.with_name(f"{log.stem}-profiling-clash.log"))
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, text[-6000:]
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def _saved(model: str, tensor: int, tmp: Path) -> dict[str, Any]:
    """A native start (its greedy tokens), then the SAVE Job on GPU 0 (rank 0 of `tensor`)."""
    from ember.engines.vllm.args import engine_args
    from ember.engines.vllm.job import save_job
    from ember_bench.vllm import write_config

    ident = _identity(model, write_config(model, 2, tmp / "config"), tensor)
    args = [*engine_args(ident), *EXTRA]
    native = _engine(args, _env("native", args, tmp / "cache-native", {}), tmp / "native.log")
    saved_env = dict(os.environ)
    os.environ.update(VLLM_CACHE_ROOT=str(tmp / "cache-save"), VLLM_USE_FLASHINFER_SAMPLER="0",
                      HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="0")
    try:
        summary = save_job(ident.model_dump_json(), (tmp / "store").as_uri(), EXTRA, work=tmp / "job",
                           timeout=1200)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert summary["published"] is True, summary
    # where SAVE's time went: the V2 runner's proof took minutes here (h200-20261129d)
    print("SAVE", model, summary["durations"], summary["proof_slowest"],
          f"bitwise {summary['bitwise_proven']} of {summary['graphs']}", summary["native_nondeterministic"])
    assert 0 < len(summary["proof_slowest"]) <= 3
    return {"ident": ident, "args": args, "native": native, "store": tmp / "store"}


def _load(saved: dict[str, Any], tmp: Path, fault: str = "",
          more: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A LOAD from an empty cache root; (its result, the plugin's report, the engine's log)."""
    from ember.engines.vllm import report as reports

    path = tmp / "report" / "vllm-report.json"
    path.parent.mkdir(parents=True)
    extra = {"EMBER_VLLM_ARCHIVE": str(saved["store"] / "archives" / saved["ident"].hash()),
             "EMBER_VLLM_REPORT": str(path), **({"EMBER_FAULT": fault} if fault else {}), **(more or {})}
    args = saved["args"]
    got = _engine(args, _env("load", args, tmp / "cache-load", extra), tmp / "load.log")
    return got, reports.read(path), (tmp / "load.log").read_text()


@pytest.fixture(scope="module", params=["llama-3-8b", "qwen3-moe"])  # the V2 runner, the V1 runner
def one_gpu(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved(str(request.param), 1, tmp_path_factory.mktemp(f"canary-{request.param}"))


def test_a_restore_passes_its_canary_against_saves_native_steps(
        one_gpu: dict[str, Any], tmp_path: Path) -> None:
    got, rep, log = _load(one_gpu, tmp_path)
    stages = rep["stages"]
    assert stages["capture"]["how"] == "restored", (stages, log[-3000:])
    verify = stages["verify"]
    assert verify["ok"] is True and verify["verify_ms"] > 0, verify
    scratch = verify.get("scratch") or {}
    print("scratch", scratch)  # what was poisoned beside the outputs (-rA shows it)
    # the PIECEWISE step's graphs write buffers inside (the MLP's activation): some were poisoned
    assert (scratch.get("bytes") or {}).get("piecewise", 0) > 0, scratch
    # against SAVE's fingerprint the PIECEWISE step's pieces were compared, not only its end
    print("pieces", verify.get("pieces"))
    assert verify["pieces"].get("piecewise", 0) > 0, verify
    # one GPU: both steps against SAVE's fingerprints, each through templates, an update, own execs
    every_path = "template+exec update+own exec"
    assert verify["checked"] == [f"piecewise:{every_path}", f"full:{every_path}"], verify
    assert verify["kv"] == ["full"], verify  # the FULL step wrote and read real KV slots
    assert got["captured_at_start"] == 0 and got["tokens"] == one_gpu["native"]["tokens"]


# what each fault logs where it changed something (a fault that found nothing to change is skipped)
CHANGED = {"kernel-arg": "kernel argument(s)", "own-exec": "kernel argument(s)",
           "kv-write": "KV cache write(s)"}


@pytest.mark.parametrize("fault", ["kernel-arg", "skip-kernel", "stale-update", "own-exec", "kv-write"])
def test_a_faulty_restore_is_refused_before_any_request_and_native_serves(
        one_gpu: dict[str, Any], tmp_path: Path, fault: str) -> None:
    from ember.contract import reason_class

    got, rep, log = _load(one_gpu, tmp_path, fault)
    if fault in CHANGED and CHANGED[fault] not in log:
        pytest.skip(f"{fault}: nothing of these graphs qualifies (nothing changed)")
    stages = rep["stages"]
    reason = (stages.get("load_refused") or {}).get("reason", "")
    if not reason:  # the canary passed it: only right if the fault changed nothing the engine serves
        assert got["tokens"] == one_gpu["native"]["tokens"], f"the canary passed {fault}, and tokens changed"
        said = [line for line in log.splitlines() if "fault:" in line][:1]
        scratch = stages["verify"].get("scratch")  # what was poisoned beside the outputs, what SAVE found
        pytest.skip(f"{fault} changed no token and the canary passed it: inert here {said}; "
                    f"scratch {scratch}")
    assert reason.startswith(CANARY) and reason_class(reason) == "canary-differs", (stages, log[-3000:])
    # the path that saw it: an own-exec fault corrupts the own execs alone, not the templates' graphs
    assert fault != "own-exec" or "on its own exec" in reason, reason
    # a FULL graph without its KV cache writes: only the FULL step over real KV slots shows it
    assert fault != "kv-write" or "full:" in reason, reason
    assert stages["verify"]["ok"] is False and stages["capture"]["how"] == "native-after-refusal"
    assert got["tokens"] == one_gpu["native"]["tokens"]  # vLLM captured its own graphs and served


@pytest.mark.parametrize("fault", ["", "kernel-arg", "kv-write"])
def test_against_eager_steps_as_n_ranks_check_each_piece_is_compared(
        one_gpu: dict[str, Any], tmp_path: Path, fault: str) -> None:
    """How N ranks check (SAVE saw no data there), on one GPU (`EMBER_VLLM_CANARY_EAGER`): the
    restored steps against the same steps without graphs, each PIECEWISE piece's outputs included
    at the same positions. A clean restore passes it; corrupted kernel arguments are refused (the
    q, k and v they change reach no step's end: only the pieces show them), so are a FULL graph's
    KV cache writes left out (against the eager FULL step over the same real KV slots), and native
    serves."""
    got, rep, log = _load(one_gpu, tmp_path, fault, {"EMBER_VLLM_CANARY_EAGER": "1"})
    stages = rep["stages"]
    verify = stages["verify"]
    if not fault:
        assert verify["ok"] is True and stages["capture"]["how"] == "restored", (verify, log[-3000:])
        assert verify["checked"] == ["piecewise:template+exec update+own exec",
                                     "full:template+exec update+own exec"], verify
        print("pieces", verify.get("pieces"), "parts", verify.get("parts_ms"))
        assert verify["pieces"].get("piecewise", 0) > 0, verify
        assert got["captured_at_start"] == 0
    else:
        if CHANGED[fault] not in log:
            pytest.skip(f"{fault}: nothing of these graphs qualifies (nothing changed)")
        reason = (stages.get("load_refused") or {}).get("reason", "")
        assert reason.startswith(CANARY) and stages["capture"]["how"] == "native-after-refusal", (
            stages, log[-3000:])
    assert got["tokens"] == one_gpu["native"]["tokens"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    return _saved("llama-3-8b", 2, tmp_path_factory.mktemp("canary-tp2"))


def test_a_clean_tp2_restore_passes_the_canary_on_both_ranks(tp2: dict[str, Any], tmp_path: Path) -> None:
    from ember.engines.vllm import report as reports

    got, rep, log = _load(tp2, tmp_path)
    ranks = rep.get("ranks") or {}
    assert sorted(ranks) == ["0", "1"] and reports.ranks_restored(rep), (rep, log[-3000:])
    for r, one in ranks.items():
        verify = reports.verify_cost(one)
        assert verify["ok"] is True, (r, verify)
        # N ranks: each step against the same step without graphs (FULL: built with the capture's metadata)
        assert verify["checked"] == ["piecewise:template+exec update+own exec",
                                     "full:template+exec update+own exec"], verify
        assert verify["pieces"].get("piecewise", 0) > 0, verify  # its pieces' outputs too, not only its end
        assert verify["kv"] == ["full"], (r, verify)  # the FULL step over real KV slots, every rank
    assert got["tokens"] == tp2["native"]["tokens"]


def test_a_wrong_splice_is_refused_on_every_rank_and_both_capture_natively(
        tp2: dict[str, Any], tmp_path: Path) -> None:
    from ember.contract import reason_class
    from ember.serving.vllm import _not_restored

    got, rep, log = _load(tp2, tmp_path, "splice-redop")
    ranks = rep.get("ranks") or {}
    assert sorted(ranks) == ["0", "1"], (rep, log[-3000:])
    for r, one in ranks.items():
        stages = one["stages"]
        assert stages["load_refused"]["reason"].startswith(CANARY), (r, stages)
        assert stages["capture"]["how"] == "native-after-refusal", (r, stages)
    why = _not_restored(rep, [one["stages"] for one in ranks.values()])
    assert reason_class(why) == "canary-differs" and "(restored on 0 of 2 ranks)" in why, why
    assert got["tokens"] == tp2["native"]["tokens"]


def test_without_the_full_eager_reference_the_full_step_is_reported_unchecked(
        tp2: dict[str, Any], tmp_path: Path) -> None:
    """EMBER_VLLM_CANARY_FULL_EAGER=0: the FULL decode step has no reference on N ranks; it is
    named unchecked in the report (not silent, not a refusal) and the ranks still restore."""
    from ember.engines.vllm import report as reports

    got, rep, log = _load(tp2, tmp_path, more={"EMBER_VLLM_CANARY_FULL_EAGER": "0"})
    assert sorted(rep.get("ranks") or {}) == ["0", "1"], (rep, log[-3000:])
    for r, one in (rep.get("ranks") or {}).items():
        verify = reports.verify_cost(one)
        assert verify["ok"] is True, (r, verify, log[-3000:])
        assert verify["checked"] == ["piecewise:template+exec update+own exec", "full:unchecked"], verify
    assert "no reference for the full step" in log
    assert reports.ranks_restored(rep) and got["tokens"] == tp2["native"]["tokens"]


def test_a_tp2_rank_failing_inside_the_canary_ends_the_start_within_its_bound(
        tp2: dict[str, Any], tmp_path: Path) -> None:
    """`canary-raise`: rank 1 fails before its canary's first step and goes to the vote, while rank
    0 waits in the canary's first collective. Without the bound both would wait for NCCL's timeout
    (minutes); with it (20 s here) each worker ends, stacks first, and the start fails soon after:
    a pod's crash marker then makes its next start native (tests/sidecar)."""
    import time

    from ember_bench.vllm import run_session

    bound = 20
    extra = {"EMBER_VLLM_ARCHIVE": str(tp2["store"] / "archives" / tp2["ident"].hash()),
             "EMBER_VLLM_REPORT": str(tmp_path / "report" / "vllm-report.json"),
             "EMBER_FAULT": "canary-raise", "EMBER_VLLM_CANARY_TIMEOUT_S": str(bound)}
    (tmp_path / "report").mkdir()
    args, log = tp2["args"], tmp_path / "load.log"
    t = time.perf_counter()
    rc = run_session([sys.executable, "-c", ENGINE, json.dumps(args)],
                     _env("load", args, tmp_path / "cache-load", extra), log, 300)
    took, text = time.perf_counter() - t, log.read_text()
    assert rc not in (0, "timeout") and "RESULT " not in text, text[-4000:]
    assert "injected fault canary-raise" in text and text.count("Timeout (") >= 2, text[-6000:]  # both ranks
    assert took < 240, took  # engine start (~60-120 s) and the bound, not NCCL's timeout
