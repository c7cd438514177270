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
    from ember.bench_graphs import bench_one

    r = bench_one(workload, LAYERS, SIZES, store, timeout=600)
    assert "load_ms" in r, r.get("load_error") or r.get("save_error") or r.get("native_error") or r
    n = r["graphs"]
    assert r["outputs_identical_vs_save"]["identical"] == n, r["outputs_identical_vs_save"]
    assert r["outputs_identical_vs_native"] == n
    assert r["tokens_identical"] and all(r["tokens_identical"].values()), r["tokens_identical"]


def _save(workload: str, store: str) -> str:
    from ember.runtime.session import preload_env

    cmd = [
        sys.executable,
        "-c",
        "import sys; from ember.cli import app; sys.argv[0]='ember'; app()",
        "save",
        "--workload",
        workload,
        "--layers",
        str(LAYERS),
        "--sizes",
        SIZES,
        "--store",
        store,
    ]
    p = subprocess.run(cmd, env=preload_env("save", _env()), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{") :])["identity"]


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
    assert ok["path"] == "restored" and ok["tokens_sha256"] == ok["saved_sha256"]
    # An environment variable in the compatibility key differs → refused before any graph work.
    mismatch = _child(base, {"TORCHINDUCTOR_MAX_AUTOTUNE": "0"})
    assert mismatch["path"] == "native" and "compatibility key" in mismatch["refused"]
    assert mismatch["tokens_sha256"] == ok["tokens_sha256"]
    # An allocation SAVE never made → libember reports divergence → refused, native capture instead.
    diverged = _child({**base, "inject_divergence": True})
    assert diverged["path"] == "native" and "diverged" in diverged["refused"]
    assert diverged["tokens_sha256"] == ok["tokens_sha256"]
