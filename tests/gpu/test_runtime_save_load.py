"""GPU: SAVE in one process, LOAD in another (perturbed, default allocator), bit-identical outputs.

Every test spawns fresh processes under libember (LD_PRELOAD) exactly as `ember save` /
`ember load` do. Small layer counts and a few sizes keep it within minutes; `ember bench graphs`
runs the full shapes and all 67 sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

pytest.importorskip("torch")
SIZES = "1,8,16"
LAYERS = 2
CHILD = Path(__file__).with_name("test_runtime_child.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


def _need_lib() -> None:
    from ember import native

    if native.find_library() is None:
        pytest.skip("libember.so not built")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tmp_path_factory.mktemp("store").as_uri()


@pytest.mark.parametrize("workload", ["llama3-8b", "qwen3-8b-compile", "qwen3-moe", "gemma3"])
def test_save_then_load_in_fresh_perturbed_process(workload: str, store: str) -> None:
    _need_lib()
    from ember_bench.graphs import bench_one, tokens_goal

    r = bench_one(workload, LAYERS, SIZES, store, timeout=600)
    assert "load_ms" in r, r.get("load_error") or r.get("save_error") or r.get("native_error") or r
    assert r["programmatic_edges_intact"] is True, r.get("proof_notes")
    n = r["graphs"]
    unstable = set(r.get("native_nondeterministic") or {})
    # Graphs whose captured form is not bit-stable on its own may differ; every other must not.
    differ = set(r["outputs_identical_vs_save"]["differ"])
    assert differ <= unstable, (differ, unstable)
    assert r["outputs_identical_vs_save"]["identical"] >= n - len(unstable), r["outputs_identical_vs_save"]
    assert r["outputs_identical_vs_native"] >= n - len(unstable)
    goal = tokens_goal(r)
    if goal is None:  # the controls failed: native decoding itself differs between runs/processes
        pytest.xfail(
            f"native decoding not reproducible, tokens cannot judge the restore: {r['tokens_verdict']}"[:300]
        )
    assert goal, (r["tokens_verdict"], r["tokens_first_divergence"])


# cuBLAS picks GEMMs of several topologies among these: the small sizes on an H100, the large on an H200
UNION_SIZES = "1,2,4,8,16,24,32,48,64,128,280,304,312,320,344,384"


@pytest.mark.parametrize("programmatic, memsets", [("0", "0"), ("1", "0"), ("1", "1")],
                         ids=["default-edges", "programmatic-edges", "programmatic-edges-and-memsets"])
def test_union_templates_serve_every_size_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, programmatic: str, memsets: str
) -> None:
    """SAVE with union templates (EMBER_UNION_TEMPLATES=1): one exec serves sizes of several
    topologies through exec update + disabled kernel slots, proven by SAVE; LOAD's outputs and
    tokens match SAVE's. With EMBER_UNION_PROGRAMMATIC=1, chains with programmatic edges join;
    with EMBER_UNION_MEMSETS=1, chains with other memsets (placeholders writing scratch)."""
    _need_lib()
    from ember_bench.graphs import bench_one, tokens_goal

    monkeypatch.setenv("EMBER_UNION_TEMPLATES", "1")
    monkeypatch.setenv("EMBER_UNION_PROGRAMMATIC", programmatic)
    monkeypatch.setenv("EMBER_UNION_MEMSETS", memsets)
    r = bench_one("llama3-8b", LAYERS, UNION_SIZES, tmp_path.as_uri(), timeout=600)
    assert "load_ms" in r, r.get("load_error") or r.get("save_error") or r.get("native_error") or r
    assert not r.get("union_templates_dropped"), r["union_templates_dropped"]  # their proof failed
    if not r.get("union_templates"):
        pytest.skip(f"these sizes share one topology on this GPU: nothing to unite ({r.get('proof_notes')})")
    assert r["union_templates"] >= 1 and r["groups"] < len(UNION_SIZES.split(",")), r["groups"]
    unstable = set(r.get("native_nondeterministic") or {})
    assert set(r["outputs_identical_vs_save"]["differ"]) <= unstable, r["outputs_identical_vs_save"]
    assert r["outputs_identical_vs_native"] >= r["graphs"] - len(unstable)
    goal = tokens_goal(r)
    if goal is None:
        pytest.xfail(f"native decoding not reproducible: {r['tokens_verdict']}"[:300])
    assert goal, (r["tokens_verdict"], r["tokens_first_divergence"])


def _save(workload: str, store: str, extra: dict[str, str] | None = None) -> str:
    return _save_summary(workload, store, extra)["identity"]


def _save_summary(workload: str, store: str, extra: dict[str, str] | None = None) -> dict:
    from ember.runtime.session import ember_argv, preload_env

    args = ["--workload", workload, "--layers", str(LAYERS), "--sizes", SIZES, "--store", store]
    cmd = ember_argv("save", *args)
    env = preload_env("save", {**_env(), **(extra or {})})
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{") :])


def test_a_save_names_its_slowest_graphs_and_their_kernels(store: str) -> None:
    """Every graph's proof "slow" (EMBER_PROOF_PROFILE_S tiny): the summary names the three
    slowest, slowest first, and the profiler's kernels of the first (under libember)."""
    _need_lib()
    summary = _save_summary("llama3-8b", store, {"EMBER_PROOF_PROFILE_S": "1e-9"})
    slowest = summary["proof_slowest"]
    assert len(slowest) == 3 and [x["s"] for x in slowest] == sorted((x["s"] for x in slowest), reverse=True)
    assert all(x["out_bytes"] > 0 for x in slowest)
    kernels = slowest[0]["kernels"]
    assert kernels and not kernels[0].startswith("the profiler could not run"), kernels
    assert all(" ms (" in k for k in kernels), kernels
    assert "kernels" not in slowest[1]


def _child(args: dict, env_extra: dict[str, str] | None = None) -> dict:
    from ember.runtime.session import preload_env

    env = preload_env("load", {**_env(), **(env_extra or {})})
    p = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_compat_mismatch_and_divergence_fall_back_cleanly(store: str) -> None:
    _need_lib()
    ident = _save("llama3-8b", store)
    base = {
        "store": store,
        "identity": ident,
        "workload": "llama3-8b",
        "layers": LAYERS,
        "sizes": SIZES,
        "batch": 8,
    }
    ok = _child(base)
    assert ok["path"] == "restored" and ok["background"], ok
    # The same archive with the templates built after the replay (no background thread).
    fg = _child(base, {"EMBER_LOAD_BACKGROUND": "0"})
    assert fg["path"] == "restored" and not fg["background"], fg
    assert fg["tokens_sha256"] == ok["tokens_sha256"]
    # An environment variable in the compatibility key differs → refused before any graph work.
    mismatch = _child(base, {"TORCHINDUCTOR_MAX_AUTOTUNE": "0"})
    assert mismatch["path"] == "native" and "compatibility key" in mismatch["refused"]
    # An allocation SAVE never made → libember reports divergence → refused, native capture instead.
    diverged = _child({**base, "inject_divergence": True})
    assert diverged["path"] == "native" and "diverged" in diverged["refused"]
    # The two fallbacks are two fresh native processes: the control for the token comparison.
    natives = {mismatch["tokens_sha256"], diverged["tokens_sha256"], ok["saved_sha256"]}
    if len(natives) != 1:
        pytest.xfail("native decoding differs between fresh processes: tokens cannot judge the restore")
    assert ok["tokens_sha256"] == ok["saved_sha256"] == mismatch["tokens_sha256"]
