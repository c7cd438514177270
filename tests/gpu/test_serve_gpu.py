"""`ember serve` with a standalone sidecar on a GPU: the archive is restored and the first token
served; with a corrupted archive the server falls back to native capture and still serves the
same tokens. Both as real processes (`ember-sidecar --standalone`, `ember serve`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from support.serving import serve

from ember_bench.cb import REF_PROMPT, phase_env, run_child

pytestmark = pytest.mark.gpu

MODEL = ["--model", "llama-3-8b", "--layers", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("serve")
    store = work / "store"
    opts = {
        "model": "llama-3-8b",
        "layers": 2,
        "store": store.as_uri(),
        "store_dir": str(store),
        "work_dir": str(work),
    }
    save = run_child("save", opts, work, 300, env=phase_env("save"))
    assert "error" not in save and save["archive"]["published"], save.get("traceback", save)
    return {"store": store, "identity": save["archive"]["identity"], "reference": save["reference"]}


def test_sidecar_hands_over_and_serve_restores(saved: dict[str, Any], tmp_path: Path) -> None:
    health, tokens, logs = serve(MODEL, tmp_path / "run", REF_PROMPT, store=saved["store"],
                                 identity=saved["identity"])
    assert health["mode"] == "restored", (health, logs)
    assert health["graphs"] > 0 and "load" in health["stages"]
    assert tokens == saved["reference"]


def test_corrupted_archive_falls_back_to_native_and_serves_the_same_tokens(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(saved["store"], store)
    blob = max((store / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    health, tokens, logs = serve(MODEL, tmp_path / "run", REF_PROMPT, store=store, identity=saved["identity"])
    assert health["mode"] == "native" and "digest-mismatch" in health["reason"], (health, logs)
    assert tokens == saved["reference"]
