"""GPU, two devices: LOAD's canary refuses a per-rank value frozen at SAVE, on every rank.

The EP workload with the fault it once had (`EMBER_DECODE_FAULT=view-offset`: a rank's experts
through a view offset, which SAVE captures as rank 0's) is saved on one GPU and LOADed by two
ranks; each rank's canary compares its restored graph with its own eager step and the verdict is
unanimous: both refuse with `canary differs` before any request. The same shape without the fault
restores on both ranks with tokens and outputs identical to the native two-rank capture.
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


@pytest.fixture
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE", "EMBER_DECODE_FAULT")}
    return {**env, "NCCL_NVLS_ENABLE": "0", "CUDA_VISIBLE_DEVICES": "0,1", **extra}


def _shape(store: Path, **fault: str) -> tuple[list[dict], list[dict]]:
    from ember.runtime.session import preload_env
    from ember_bench import parallel

    args = {**ARGS, "store": store.as_uri()}
    native = parallel._ranks("native", args, _env(**fault), 2, 900)
    saved = parallel._save(args, _env(**fault), 900)
    assert "error" not in saved, saved
    load_env = preload_env("load", _env(**fault))
    loaded = parallel._ranks("load", {**args, "identity": saved["identity"]}, load_env, 2, 900)
    return native, loaded


def test_a_rank_value_frozen_at_save_is_refused_on_every_rank(two_gpus: None) -> None:
    _, loaded = _shape(Path(tempfile.mkdtemp()), EMBER_DECODE_FAULT="view-offset")
    for rank in loaded:
        assert "canary differs" in rank.get("refused", ""), rank


def test_the_same_shape_without_it_restores_on_both_ranks(two_gpus: None) -> None:
    from ember_bench import parallel

    native, loaded = _shape(Path(tempfile.mkdtemp()))
    for r, (n, lo) in enumerate(zip(native, loaded, strict=True)):
        v = parallel._verdict(r, n, lo)
        assert all(v["tokens_identical"].values()) and v["outputs_identical"] == v["outputs"], v
        assert v["verify"] == "template+exec update", v
