"""vLLM 0.26's SAVE Job as rank 0 and as rank 1 of a tensor-parallel world of 2, each on this ONE
GPU (`ember.engines.vllm.ranks`): a 2-layer random Llama-3-8B-shaped model. Each rank publishes an
archive with graphs and with its collectives recorded as placeholders of a world of 2, and the two
archives hold the same graph keys (one SAVE per identity serves every rank). LOAD of such an
archive on two real ranks: tests/gpu/test_vllm_parallel_load.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(1800),  # two Jobs, each a probe and a SAVE engine start
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def _save_as(rank: int, ident: Any, extra: list[str], tmp: Path) -> tuple[dict, Path]:
    from ember.engines.vllm.job import save_job
    from ember.engines.vllm.ranks import RANK_ENV

    store = tmp / f"store-rank{rank}"
    saved = dict(os.environ)
    os.environ.update({RANK_ENV: str(rank), "VLLM_CACHE_ROOT": str(tmp / f"cache-{rank}"),
                       "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1"})
    try:
        summary = save_job(ident.model_dump_json(), store.as_uri(), extra, work=tmp / f"job-rank{rank}",
                           timeout=900)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return summary, store


def test_each_rank_of_tp2_saves_on_one_gpu_with_the_same_graph_keys(tmp_path: Path) -> None:
    from ember.archive import bundle
    from ember.identity import ArchiveIdentity, Parallelism
    from ember_bench.vllm import write_config

    cfg = write_config("llama-3-8b", 2, tmp_path / "config")
    ident = ArchiveIdentity(model=str(cfg), engine="vllm", engine_version="0.26",
                            capture_sizes=(1, 2, 4, 8), graph_mode="full-and-piecewise",
                            max_num_tokens=2048, max_batch=8, parallelism=Parallelism(tensor=2))
    extra = ["--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.4",
             "--max-model-len", "2048", "--seed", "0"]
    keys, nodes = [], []
    for rank in (0, 1):
        summary, store = _save_as(rank, ident, extra, tmp_path)
        assert summary["published"] is True and summary["identity"] == ident.hash(), summary
        assert (summary["rank"], summary["world"]) == (rank, 2)
        assert "--distributed-executor-backend" in summary["args"]
        archive = bundle.open_archive(store, ident.hash())
        graphs = archive.manifest.graphs
        assert graphs.count > 0 and graphs.keys, graphs
        table = archive.manifest.engine.get("collectives") or {}
        assert table.get("world") == 2 and table.get("nodes"), table  # all-reduces are placeholders
        assert table.get("comms") == [{"name": "tp:0", "nranks": 2}], table  # named by vLLM's group
        keys.append(sorted(map(tuple, graphs.keys)))
        nodes.append(graphs.nodes)
    assert keys[0] == keys[1]
    assert nodes[0] == nodes[1]  # same shards, same graphs: only the rank differs


@pytest.mark.parametrize(("model", "tensor", "expert", "data"), [
    ("llama-3-8b", 2, False, 1),
    ("qwen3-moe", 2, True, 1),
    ("qwen3-moe", 1, True, 2),
], ids=["tp2", "ep2-tp2", "dp2-ep2"])
def test_a_deep_parallel_save_publishes_graphs_as_native_computes_them(
        model: str, tensor: int, expert: bool, data: int, tmp_path: Path) -> None:
    """8 layers saved under the stub, whose collectives write nothing: the proof zeroes what they
    stand for writing before every replay (`comm.stub_writes`), so each captured graph repeats
    itself and every rebuilt graph is proven bit-identical (before that, an 8-layer EP-over-TP
    SAVE's captured graph did not repeat itself, one output past 1e38: h200x2-20261130b). EP over
    TP is held to less: its MoE piece computes bf16 subnormals that differ between native replays
    from one state (h200-20261201b), so a graph may be proven within that spread, and the spread
    must stay subnormal."""
    from ember.archive import bundle
    from ember_bench.vllm import write_config
    from ember_bench.vllm_parallel import extra_args, shape_identity

    ident = shape_identity(write_config(model, 8, tmp_path / "config"), tensor, expert, data)
    summary, store = _save_as(0, ident, extra_args(0.4), tmp_path)
    assert summary["published"] is True, summary
    engine = bundle.open_archive(store, ident.hash()).manifest.engine
    facts = {k: engine.get(k) for k in ("graphs", "bitwise_proven", "within_native_spread",
                                        "native_nondeterministic")}
    if not (expert and tensor > 1):
        assert engine["bitwise_proven"] == engine["graphs"] > 0, facts
        return
    assert engine["bitwise_proven"] + engine["within_native_spread"] == engine["graphs"] > 0, facts
    spread = [max(g["native_spread"]) for g in (engine.get("native_nondeterministic") or {}).values()]
    assert all(s < 2.0 ** -126 for s in spread), facts  # below bf16's smallest normal value
