"""GPU: LOAD's canary refuses injected faults (`ember.runtime.faults`) before any request.

Two devices: a per-rank value frozen at SAVE, and a wrong splice, on every rank.

The EP workload with the fault it once had (`EMBER_FAULT=view-offset`: a rank's experts
through a view offset, which SAVE captures as rank 0's) is saved on one GPU and LOADed by two
ranks; each rank's canary compares its restored graph with its own eager step and the verdict is
unanimous: both refuse with `canary differs` before any request. The same shape without the fault
restores on both ranks with tokens and outputs identical to the native two-rank capture.
One device: a stale template update, a corrupted kernel argument and a swap to own execs that
compute otherwise (decode; CB, whose engine then serves natively with native's tokens).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

torch = pytest.importorskip("torch")

ARGS = {"workload": "qwen3-moe", "layers": 2, "sizes": "1,8,64", "tp": 1, "ep": 2, "dp": 2,
        "collectives": False}


GPUS = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",") if g]  # the ones we were given


@pytest.fixture
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE", "EMBER_FAULT")}
    return {**env, "NCCL_NVLS_ENABLE": "0", "CUDA_VISIBLE_DEVICES": ",".join(GPUS[:2]), **extra}


def _shape(store: Path, **fault: str) -> tuple[list[dict], list[dict]]:
    from ember.runtime.session import preload_env
    from ember_bench import parallel

    args = {**ARGS, "store": store.as_uri()}
    native = parallel.run_ranks("native", args, _env(**fault), 2, 900)
    saved = parallel.save_shape(args, _env(**fault), 900)
    assert "error" not in saved, saved
    load_env = preload_env("load", _env(**fault))
    loaded = parallel.run_ranks("load", {**args, "identity": saved["identity"]}, load_env, 2, 900)
    return native, loaded


def test_a_rank_value_frozen_at_save_is_refused_on_every_rank(two_gpus: None) -> None:
    _, loaded = _shape(Path(tempfile.mkdtemp()), EMBER_FAULT="view-offset")
    for rank in loaded:
        assert "canary differs" in rank.get("refused", ""), rank


def test_a_wrong_splice_is_refused_on_every_rank(two_gpus: None) -> None:
    """EMBER_FAULT=splice-redop: each rank splices its reduce-scatters with max for sum."""
    _, loaded = _shape(Path(tempfile.mkdtemp()), EMBER_FAULT="splice-redop")
    assert all("refused" in rank for rank in loaded), loaded  # each rank captures natively
    assert any("canary differs" in rank["refused"] for rank in loaded), loaded


def test_the_same_shape_without_it_restores_on_both_ranks(two_gpus: None) -> None:
    from ember_bench import parallel

    native, loaded = _shape(Path(tempfile.mkdtemp()))
    for r, (n, lo) in enumerate(zip(native, loaded, strict=True)):
        v = parallel.rank_verdict(r, n, lo)
        assert all(v["tokens_identical"].values()) and v["outputs_identical"] == v["outputs"], v
        assert v["verify"].startswith("template") and v["verify"].endswith("own exec"), v


SINGLE_GPU_FAULTS = {
    "stale-update": "after an exec update",  # the template updated away and back: another key's step
    "kernel-arg": "as instantiated",  # every restored graph has float arguments doubled, a count halved
    "own-exec": "on its own exec",  # the exec the Dedicator swaps in computes otherwise
}


@pytest.mark.parametrize("fault", SINGLE_GPU_FAULTS)
def test_a_broken_single_gpu_restore_is_refused_before_any_request(fault: str) -> None:
    """Each fault class on one GPU (decode, Llama-3-8B shape, 2 layers): the same archive restores
    without the fault, and with it the canary refuses at the path the fault breaks."""
    from ember.runtime.session import preload_env
    from ember_bench import parallel

    # from B=2: B=1 (GEMV kernels) is a group of its own, and the canary's key (the first needed)
    # must share its template for an exec update to happen at all
    args = {"workload": "llama3-8b", "layers": 2, "sizes": "2,3,4,5,6,7,8", "tp": 1, "ep": 1, "dp": 1,
            "collectives": False, "store": Path(tempfile.mkdtemp()).as_uri()}
    env = {**_env(), "CUDA_VISIBLE_DEVICES": GPUS[0]}
    saved = parallel.save_shape(args, env, 900)
    assert "error" not in saved, saved
    good = parallel.run_ranks("load", {**args, "identity": saved["identity"]}, preload_env("load", env), 1,
                              900)
    checked = good[0].get("timings", {}).get("verify", "")
    assert "refused" not in good[0] and "own exec" in checked, good[0]
    if fault == "stale-update" and "exec update" not in checked:
        pytest.fail(f"the canary's key has no other member to update to: {checked}")
    bad_env = preload_env("load", {**env, "EMBER_FAULT": fault})
    bad = parallel.run_ranks("load", {**args, "identity": saved["identity"]}, bad_env, 1, 900)
    refused = bad[0].get("refused", "")
    assert "canary differs" in refused and SINGLE_GPU_FAULTS[fault] in refused, bad[0]


@pytest.mark.parametrize("fault", SINGLE_GPU_FAULTS)
def test_a_refused_cb_restore_serves_natively_with_the_same_tokens(tmp_path: Path, fault: str) -> None:
    """The CB engine under each fault: LOAD refuses at the canary, the engine starts natively
    (as `ember serve` does) and its tokens equal native's."""
    import json

    from ember_bench import cb
    from ember_bench.correctness import ARCHITECTURES, SMALL_CONFIG

    config = {"model_type": "mistral", **SMALL_CONFIG, **ARCHITECTURES["mistral"][1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    store = tmp_path / "store"
    opts = {"model": "mistral", "model_config": str(tmp_path / "config.json"), "layers": None,
            "store": store.as_uri(), "store_dir": str(store), "work_dir": str(tmp_path)}
    lane = {"CUDA_VISIBLE_DEVICES": GPUS[0], "NCCL_NVLS_ENABLE": "0"}
    native = cb.run_child("native", opts, tmp_path, 900, env=lane)
    saved = cb.run_child("save", opts, tmp_path, 900, env={**lane, **(cb.phase_env("save") or {})})
    assert "tokens" in native and "archive" in saved, (native.get("error"), saved.get("error"))
    opts["identity"] = saved["archive"]["identity"]
    clean = {**lane, **(cb.phase_env("load") or {})}
    good = cb.run_child("load", opts, tmp_path, 900, env=clean)  # a canary that refuses everything fails here
    assert good.get("mode") == "restored" and good["tokens"] == native["tokens"], good.get("reason")
    loaded = cb.run_child("load", opts, tmp_path, 900, env={**clean, "EMBER_FAULT": fault})
    assert loaded.get("mode") == "native", loaded.get("error") or loaded.get("reason")
    assert "canary differs" in loaded.get("reason", ""), loaded.get("reason")
    assert loaded["tokens"] == native["tokens"]
