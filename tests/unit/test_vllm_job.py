"""The vLLM SAVE Job without vLLM: identity → engine arguments, the identity guard, and the Job's
two steps (sizing probe, SAVE) over a stand-in engine process that reports as ember's plugin does.

The stand-in is the `python` the Job starts its children with: it receives
`-m ember.engines.vllm.job <args JSON>` and the environment the Job gives each step, records both,
and writes the plugin's report (`EMBER_VLLM_REPORT`) as the test's FAKE_VLLM asks. What it checks
is the Job's side: which steps run, with which arguments and environment, and what it concludes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember import contract
from ember.cli import app
from ember.engines.vllm import args as vargs
from ember.engines.vllm.job import JobFailed, save_job
from ember.identity import ArchiveIdentity, Parallelism

IDENTITY = ArchiveIdentity(model="/models/llama", revision="main", engine="vllm", engine_version="0.26",
                           capture_sizes=(1, 2, 4, 8), graph_mode="full-and-piecewise",
                           compile={"mode": "3"}, dtype="bfloat16", max_num_tokens=2048, max_batch=8)

STANDIN = r'''
import json, os, sys
args = json.loads(sys.argv[3])
fake = json.loads(os.environ["FAKE_VLLM"])
mode = "probe" if os.environ.get("EMBER_VLLM_PROBE") == "1" else os.environ.get("EMBER_MODE", "native")
with open(os.path.join(fake["dir"], "calls.jsonl"), "a") as f:
    f.write(json.dumps({"mode": mode, "module": sys.argv[2], "args": args,
                        "store": os.environ.get("EMBER_VLLM_STORE"),
                        "identity": os.environ.get("EMBER_IDENTITY"),
                        "inproc": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                        "preload": "libember" in os.environ.get("LD_PRELOAD", "")}) + "\n")
stages = {}
if mode == "probe" and fake.get("probe_bytes"):
    stages["worker.determine_available_memory"] = {"t": 1.0, "seconds": 0.5, "bytes": fake["probe_bytes"]}
if mode == "save":
    outcome = fake.get("save", "ok")
    if outcome == "crash":
        print("CUDA error: out of memory while capturing", flush=True)
        sys.exit(3)
    if outcome == "refused":
        stages["save_refused"] = {"reason": "ProofFailed: 3 graphs differ"}
    else:
        given = json.loads(os.environ.get("EMBER_IDENTITY") or "{}")  # the plugin publishes under it
        ident = fake["identity"] if outcome == "ok" and given.get("model") else "0" * 64
        stages["save"] = {"t": 2.0, "published": True, "identity": ident, "graphs": 1734, "bytes": 7142295,
                          "manifest_digest": "ab" * 32, "durations": {"capture_s": 6.9}, "seconds": 35.2}
with open(os.environ["EMBER_VLLM_REPORT"], "w") as f:
    json.dump({"stages": stages}, f)
'''


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{STANDIN}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)

    def run(**fake: object) -> None:
        fake = {"dir": str(tmp_path), "identity": IDENTITY.hash(), **fake}
        monkeypatch.setenv("FAKE_VLLM", json.dumps(fake))

    def calls() -> list[dict]:
        path = tmp_path / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    run.calls = calls  # type: ignore[attr-defined]
    run.python = str(script)  # type: ignore[attr-defined]
    return run


def test_identity_becomes_vllm_arguments() -> None:
    a = vargs.engine_args(IDENTITY)
    opt = {a[i]: a[i + 1] for i in range(0, len(a) - 1, 2) if a[i].startswith("--")}
    assert opt["--model"] == "/models/llama" and opt["--dtype"] == "bfloat16"
    assert opt["--max-num-seqs"] == "8" and opt["--max-num-batched-tokens"] == "2048"
    cc = json.loads(opt["--compilation-config"])
    assert cc == {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8], "mode": 3,
                  "inductor_compile_config": {"deterministic": True, "combo_kernels": True,
                                              "benchmark_combo_kernel": False}}
    assert "--tensor-parallel-size" not in a and "--enable-expert-parallel" not in a
    moe = IDENTITY.model_copy(update={"parallelism": Parallelism(tensor=2, expert=4, data=2)})
    b = vargs.engine_args(moe)
    assert b[b.index("--tensor-parallel-size") + 1] == "2" and b[b.index("--data-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" in b


def _resolved(**change: object) -> dict:
    base = {"model": "/models/llama", "revision": "main", "dtype": "bfloat16", "engine_version": "0.26.0",
            "capture_sizes": [8, 4, 2, 1], "cudagraph_mode": "FULL_AND_PIECEWISE", "max_num_seqs": 8,
            "max_num_batched_tokens": 2048, "parallelism": {"tensor": 1, "expert": 1, "data": 1}}
    return {**base, **change}


def test_a_vllm_that_is_not_the_identity_is_named() -> None:
    assert vargs.mismatches(IDENTITY, _resolved()) == []  # "0.26" pins 0.26.x; size order is free
    for field, value in [("capture_sizes", [1, 2, 4]), ("cudagraph_mode", "PIECEWISE"), ("max_num_seqs", 16),
                         ("dtype", "float16"), ("engine_version", "0.27.0"), ("model", "/models/other"),
                         ("max_num_batched_tokens", 8192), ("parallelism", vargs.parallelism(2, 1, False))]:
        problems = vargs.mismatches(IDENTITY, _resolved(**{field: value}))
        assert len(problems) == 1 and problems[0].startswith(field), (field, problems)
    assert vargs.mismatches(IDENTITY, _resolved(engine_version="0.260.1"))  # a prefix is not a pin
    other = IDENTITY.model_copy(update={"engine": "transformers"})
    assert vargs.mismatches(other, _resolved())[0].startswith("engine")


def test_the_job_sizes_then_saves_under_the_identity(standin, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.ENV_IDENTITY, raising=False)  # the Job hands it on, not its environment
    standin(probe_bytes=54063072359)
    out = save_job(IDENTITY.model_dump_json(), "file:///store", ["--load-format", "dummy"],
                   work=tmp_path / "w", python=standin.python)
    probe, save = standin.calls()
    assert probe["mode"] == "probe" and not probe["preload"] and probe["module"] == "ember.engines.vllm.job"
    assert save["mode"] == "save" and save["preload"] and save["store"] == "file:///store"
    assert save["identity"] == IDENTITY.model_dump_json() and probe["identity"] is None
    assert probe["inproc"] == save["inproc"] == "0"  # the plugin runs in the process the Job watches
    assert probe["args"] == [*vargs.engine_args(IDENTITY), "--load-format", "dummy"]
    assert save["args"] == [*probe["args"], "--kv-cache-memory-bytes", "54063072359"]
    assert out["identity"] == IDENTITY.hash() and out["published"] is True and out["graphs"] == 1734
    assert set(out["durations"]) == {"capture_s", "probe_process_s", "save_process_s"}


def test_fixed_kv_bytes_skip_the_probe(standin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    standin()
    save_job(IDENTITY.model_dump_json(), "file:///s", ["--kv-cache-memory-bytes=1000000"],
             work=tmp_path / "w", python=standin.python)
    assert [c["mode"] for c in standin.calls()] == ["save"]


@pytest.mark.parametrize(("fake", "reason"), [
    ({"probe_bytes": 0}, "sizing"),
    ({"probe_bytes": 10, "save": "refused"}, "SAVE: ProofFailed: 3 graphs differ"),
    ({"probe_bytes": 10, "save": "crash"}, "ended with 3 (CUDA error: out of memory"),
    ({"probe_bytes": 10, "save": "wrong-identity"}, "not the Job's identity"),
])
def test_the_job_fails_with_the_reason(standin, tmp_path: Path, fake: dict, reason: str) -> None:  # type: ignore[no-untyped-def]
    standin(**fake)
    with pytest.raises(JobFailed, match=reason.replace("(", r"\(")):
        save_job(IDENTITY.model_dump_json(), "file:///s", [], work=tmp_path / "w", python=standin.python)


def test_a_shape_no_rank_can_play_is_refused_before_any_engine_starts(  # type: ignore[no-untyped-def]
    standin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin(probe_bytes=10)
    bad = IDENTITY.model_copy(update={"parallelism": Parallelism(tensor=2, expert=3)})
    with pytest.raises(JobFailed, match=r"expert 3 must be tensor x data = 2"):
        save_job(bad.model_dump_json(), "file:///s", [], work=tmp_path / "w", python=standin.python)
    assert standin.calls() == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_ember_save_job_runs_the_vllm_job_and_reports_to_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ember save --job -- <args>` with a vllm identity takes the vLLM path (not the decode
    workloads) and reports through the termination log; here vLLM is not installed, so the sizing
    step fails and the reason names it."""
    term = tmp_path / "termination-log"
    monkeypatch.setenv(contract.ENV_IDENTITY, IDENTITY.model_dump_json())
    monkeypatch.setenv(contract.ENV_STORE, (tmp_path / "store").as_uri())
    monkeypatch.setenv(contract.ENV_TERMINATION_LOG, str(term))
    res = CliRunner().invoke(app, ["save", "--job", "--", "--load-format", "dummy"])
    assert res.exit_code == 1
    reason = term.read_text()
    assert reason.startswith("SAVE failed: JobFailed: sizing") and "No module named 'vllm'" in reason
    assert not (tmp_path / "store").exists()  # nothing published
    assert os.environ.get("EMBER_MODE") is None  # the job did not re-exec itself under libember


def test_with_mega_aot_embers_vllm_processes_pin_how_the_model_is_stored_and_native_is_plain_vllm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SAVE, its sizing probe and LOAD must find one compiled model (the setting is in vLLM's
    compile-cache hash), whatever the caller's environment says; a native start keeps vLLM's own.
    Off (the default, pinned in pods), nothing is set and the identity is as before."""
    inherited = {"VLLM_USE_MEGA_AOT_ARTIFACT": "0", "VLLM_USE_STANDALONE_COMPILE": "0"}
    monkeypatch.delenv("EMBER_VLLM_MEGA_AOT", raising=False)
    assert vargs.process_env("probe", inherited)["VLLM_USE_MEGA_AOT_ARTIFACT"] == "0"
    assert vargs.identity_workload() == vargs.IDENTITY_WORKLOAD and "compiled" not in vargs.IDENTITY_WORKLOAD
    monkeypatch.setenv("EMBER_VLLM_MEGA_AOT", "1")
    probe = vargs.process_env("probe", inherited)
    assert {k: probe[k] for k in vargs.COMPILE_ENV} == vargs.COMPILE_ENV == {
        "VLLM_USE_MEGA_AOT_ARTIFACT": "1", "VLLM_USE_STANDALONE_COMPILE": "1"}
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" not in vargs.process_env("native", {})
    assert vargs.process_env("native", inherited)["VLLM_USE_MEGA_AOT_ARTIFACT"] == "0"
    # an archive stored otherwise is another identity
    assert vargs.identity_workload() == {**vargs.IDENTITY_WORKLOAD, "compiled": "mega-aot"}


def test_a_vllm_process_inherits_none_of_embers_per_process_variables(monkeypatch) -> None:
    """`process_env`, shared by the Job's steps, `ember serve --engine vllm` and the bench: a probe
    flag, an archive or a store left in the caller's environment never reaches another process."""
    from ember import native

    inherited = {"EMBER_VLLM_PROBE": "1", "EMBER_VLLM_ARCHIVE": "/a", "EMBER_VLLM_STORE": "s3://x",
                 "EMBER_MODE": "save", "EMBER_ARM": "auto", "LD_PRELOAD": "/x/libother.so", "KEEP": "1"}
    native_env = vargs.process_env("native", inherited)
    assert native_env == {"KEEP": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if native.find_library() is None:
        pytest.skip("libember not built")
    load = vargs.process_env("load", inherited)
    assert load["EMBER_MODE"] == "load" and load["EMBER_ARM"] == "manual" and "libember" in load["LD_PRELOAD"]
    assert not {"EMBER_VLLM_PROBE", "EMBER_VLLM_ARCHIVE", "EMBER_VLLM_STORE"} & set(load)
