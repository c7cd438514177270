"""CPU: `ember bench vllm-switch`'s processes end to end with a stand-in engine (no vLLM): the old
shape serves until it is told to stop, each switch is timed to the new process's first token,
every process gets its GPUs, and the report reads their files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ember_bench import vllm_parallel
from ember_bench import vllm_switch as vs
from ember_bench.vllm_switch_plan import plan, shape

FAKE_CHILD = r'''
import json, os, sys, time
from pathlib import Path
T0 = time.monotonic()
from ember.engines.vllm import report

a = json.loads(sys.argv[1])
time.sleep(0.3)  # the engine's start
first = time.monotonic()
Path(a["events"]).write_text(json.dumps({"start_mono": T0, "first_token_mono": first}))
res = {"first_token_s": first - T0, "first_token_mono": first, "engine_init_s": 0.2, "import_s": 0.05,
       "gpus": os.environ["CUDA_VISIBLE_DEVICES"], "mode": os.environ.get("EMBER_MODE"),
       "cache": os.environ.get("VLLM_CACHE_ROOT")}
gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
how = "restored" if os.environ.get("EMBER_VLLM_ARCHIVE") else "native"
for r in range(len(gpus)):
    graphs = {"at_start": 0 if how == "restored" else 9, "serving": 0}
    stages = {"capture": {"how": how, "seconds": 0.1}, "cudagraphs": graphs}
    report.write(os.environ["EMBER_VLLM_REPORT"], {"stages": stages}, (r, len(gpus)))
if a["role"] == "serve":
    i = 0
    with open(a["requests_log"], "a") as log:
        while not Path(a["stop"]).exists():
            sent = time.monotonic()
            time.sleep(0.01)
            log.write(json.dumps({"i": i, "sent": sent, "done": time.monotonic(), "ok": True}) + "\n")
            log.flush()
            i += 1
            time.sleep(a["interval_s"])
else:
    res["tokens"] = {str(b): {f"dp{r}": [[b, r]] * b for r in range(a["dp"])} for b in a["batch_sizes"]}
Path(a["out"]).write_text(json.dumps(res))
'''


def _env(mode: str, args: list[str], work: Path, extra: dict[str, str]) -> dict[str, str]:
    """vllm_parallel.child_env without libember: its cache root (test below), the mode."""
    return {**os.environ, "EMBER_MODE": mode, "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{mode}"), **extra}


def test_the_native_cache_root_native_warm_starts_on(tmp_path: Path) -> None:
    env = vllm_parallel.child_env("native", [], tmp_path / "runs" / "new-native", {})
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "runs" / "new-native" / "vllm-cache-native")


def test_a_switch_of_stand_in_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_switch_child.py").write_text(FAKE_CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(vs, "CHILD_MODULE", "fake_switch_child")
    monkeypatch.setattr(vllm_parallel, "child_env", _env)
    saved: list[str] = []

    def save(ident: Any, p: Any, work: Path, opts: Any) -> dict[str, Any]:
        saved.append(ident.hash())
        archive = work / "store" / "archives" / ident.hash()
        return {"published": True, "save_job_s": 1.0, "archive": str(archive)}

    monkeypatch.setattr(vs, "save", save)
    p = plan(shape(1, 2), shape(1, 4), ["4", "5", "6", "7"], 0.35)
    opts = vs.Options(baseline_s=0.4, settle_s=0.1, interval_s=0.02, timeout=30, request_timeout_s=5)
    results = vs.run_switches(p, tmp_path / "w", tmp_path / "cfg", vs.VARIANTS, opts)

    assert len(set(saved)) == 2 and set(results["identities"].values()) == set(saved)
    old, restored, native = results["old"], results["switches"]["restored"], results["switches"]["native"]
    assert (old["gpus"], restored["gpus"], native["gpus"]) == ("4,5", "4,5,6,7", "4,5,6,7")
    assert (old["mode"], restored["mode"], native["mode"]) == ("load", "load", "native")
    warm = results["switches"]["native-warm"]
    assert warm["mode"] == "native" and warm["cache"] == str(tmp_path / "w/runs/new-native/vllm-cache-native")
    assert restored["cache"] == str(tmp_path / "w/runs/new-restored/vllm-cache-load")
    assert old["rc"] == 0 and len(old["requests"]) > 10  # it served until told to stop
    assert old["requests"][-1]["sent"] > warm["exit_mono"] - 0.5  # ... after the last switch
    assert 0.3 <= restored["switch_to_first_token_s"] < 5
    assert restored["switch_mono"] < restored["first_token_mono"] < restored["exit_mono"]
    assert restored["exit_mono"] < native["switch_mono"]

    path = vs.write_report(p, opts, results, tmp_path / "out")
    summary = json.loads(path.read_text())["summary"]
    verdicts = {g["key"]: g["verdict"] for g in summary["goals"]}
    assert verdicts["restored"] == verdicts["graphs"] == verdicts["tokens"] == verdicts["old_serves"] == "met"
    assert summary["tokens"]["dp_ranks"] == {f"dp{r}": True for r in range(4)}
    assert summary["service"]["restored"]["to_first_token"]["served"] > 0
    assert summary["switches"]["native"]["ranks"]["3"]["graphs_captured_at_start"] == 9
    md = path.with_suffix(".md").read_text()
    assert "| restored | 3 | restored |" in md and "— / — / — / — / — |" in md
