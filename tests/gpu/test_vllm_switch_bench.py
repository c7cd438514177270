"""`ember bench vllm-switch` on 2 GPUs (a smoke test of the bench, ~10 min): a one-GPU Qwen3-MoE
shape (2 random layers) serving, then EP=2 started beside it, restored from its archive and
natively. The restored new shape restores on both ranks and captures no graph, its greedy tokens
equal the native start's on each DP rank, and the old shape serves through both switches."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(2400),  # two SAVE Jobs and three engine starts
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def _gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except ImportError:
        return 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_ep1_to_ep2_switch_restores_beside_a_serving_engine(tmp_path: Path) -> None:
    from ember_bench import vllm_switch as vs
    from ember_bench.vllm import write_config
    from ember_bench.vllm_switch_plan import plan, shape

    p = plan(shape(1, 1), shape(1, 2), ["0", "1"], 0.35)
    assert p.refusals == ()
    opts = vs.Options(layers=2, batch_sizes=(1, 4), max_tokens=8, baseline_s=5.0, settle_s=2.0)
    cfg = write_config("qwen3-moe", 2, tmp_path / "config")
    results = vs.run_switches(p, tmp_path / "work", cfg, ("restored", "native"), opts)
    path = vs.write_report(p, opts, results, tmp_path / "out")
    summary = json.loads(path.read_text())["summary"]
    verdicts = {g["key"]: (g["verdict"], g["value"]) for g in summary["goals"]}
    for key in ("restored", "graphs", "tokens", "old_serves"):
        assert verdicts[key][0] == "met", (key, verdicts, path.with_suffix(".md").read_text())
    assert sorted(summary["tokens"]["dp_ranks"]) == ["dp0", "dp1"]
