"""GPU: LOAD's CB canary looks only at its request's cache rows (`ember.engines.transformers_cb.canary`).

SAVE then LOAD in fresh processes (`python -m ember_bench.cb PHASE`, under libember): the restore
passes its canary (no capture while serving, the tokens SAVE served) on a dense model and on the
layer-group layouts the rows come from differently (all sliding, hybrid sliding + full); and the
canary's share of LOAD (`verify_ms`: the launches through template, exec update and own exec)
does not grow with the KV cache: a 16× larger cache, same model and key set shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ember_bench.cb import phase_env, run_child

pytestmark = pytest.mark.gpu

BLOCK = 256
SMALL_BLOCKS, LARGE_BLOCKS = 64, 1024  # 16k and 256k tokens: 0.25 and 4 GiB of K/V at 4 layers


def _sizing(blocks: int) -> dict[str, int]:
    # kv padded by the SMALL cache in both runs, so the canary's key (the first request's: kv one
    # interval) attends over the same 16k positions whatever the cache: only the cache differs.
    # (Padding by the whole cache made the key, its attention and its mask grow with the cache,
    # and the canary's cost with them: 156 vs 456 ms, benchmarks/results/h200-20261129b.)
    # A 256-token budget keeps q small; the large cache has 16 kv values per layer type.
    return {"block_size": BLOCK, "num_blocks": blocks, "max_batch_tokens": 256,
            "q_padding_interval_size": 256, "kv_padding_interval_size": SMALL_BLOCKS * BLOCK}


def _save_then_load(opts: dict[str, Any], work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    store = work / "store"
    opts = {**opts, "store": store.as_uri(), "store_dir": str(store), "work_dir": str(work)}
    save = run_child("save", opts, work, 600, env=phase_env("save"))
    assert "error" not in save, save.get("traceback", save)
    assert save["archive"]["published"], save["archive"]
    opts["identity"] = save["archive"]["identity"]
    load = run_child("load", opts, work, 600, env=phase_env("load"))
    assert "error" not in load, load.get("traceback", load)
    return save, load


def _restored_through_the_canary(save: dict[str, Any], load: dict[str, Any]) -> None:
    assert load["libember"] is True
    assert load.get("mode") == "restored", load.get("reason")
    # verify_ms is only reported for a canary that ran and passed (one skipped reports none)
    assert "verify_ms" in load, load.get("startup")
    assert load["captures_while_serving"] == 0, load["serving_capture_keys"]
    assert load["tokens"] == save["tokens"] and load["reference"] == save["reference"]


def _canary_key(store: Path, identity: str) -> list[Any]:
    from ember.archive import bundle

    return list(bundle.open_archive(store, identity).manifest.engine["canary"]["key"])


def test_the_canarys_cost_does_not_grow_with_the_cache(tmp_path: Path) -> None:
    model = {"model": "llama-3-8b", "layers": 4}
    runs, keys = {}, {}
    for name, blocks in (("small", SMALL_BLOCKS), ("large", LARGE_BLOCKS)):
        save, load = _save_then_load({**model, "sizing": _sizing(blocks)}, tmp_path / name)
        _restored_through_the_canary(save, load)
        assert load["sizing"]["num_blocks"] == blocks, load["sizing"]
        runs[name] = load["verify_ms"]
        keys[name] = _canary_key(tmp_path / name / "store", save["archive"]["identity"])
    assert keys["small"] == keys["large"], keys  # the same canary step on both caches
    small, large = runs["small"], runs["large"]
    assert large < 200, runs
    assert large <= 3 * small, runs  # the whole-cache canary grew with the cache


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_and_hybrid_layer_groups_restore_through_the_canary(tmp_path: Path, model_type: str) -> None:
    """All-sliding (mistral) and sliding + full layer groups (gemma2 1:1, gemma3 5:1): the rows of
    each group come from its own write/read indices, the sentinel and trash left out."""
    from ember_bench.correctness import ARCHITECTURES, SMALL_CONFIG

    config = {"model_type": model_type, **SMALL_CONFIG, **ARCHITECTURES[model_type][1]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    save, load = _save_then_load({"model": model_type, "model_config": str(path), "layers": None}, tmp_path)
    _restored_through_the_canary(save, load)
