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
    assert runs["load"]["graphs_captured_at_start"] == 0
    assert runs["load"]["graphs_captured_serving"] == 0
    assert runs["load"]["tokens_identical_to_native"] is True
    assert report["summary"]["save"]["graphs"] == report["summary"]["load"]["graphs"] > 0
