"""CPU: vLLM keeps compiled code per rank; LOAD on rank r copies the directory SAVE's rank
compiled into to its own name (both trees), never over one vLLM has already."""

from __future__ import annotations

from pathlib import Path

from ember.engines.vllm import compile_cache


def _tree(root: Path) -> None:
    for rel in ("torch_compile_cache/abc123/rank_0_0/backbone/artifact.bin",
                "torch_compile_cache/torch_aot_compile/def456/rank_0_0/model"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"code")


def test_saved_rank_dir_from_the_key() -> None:
    assert compile_cache.saved_rank_dir("abc123/rank_1_0/backbone") == "rank_1_0"
    assert compile_cache.saved_rank_dir("") == ""


def test_this_ranks_directory_is_a_copy_of_saves(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert compile_cache.alias_rank("abc123/rank_0_0/backbone", "rank_1_0", tmp_path) == 2
    base = tmp_path / "torch_compile_cache"
    assert (base / "abc123/rank_1_0/backbone/artifact.bin").read_bytes() == b"code"
    assert (base / "torch_aot_compile/def456/rank_1_0/model").read_bytes() == b"code"
    assert not list(base.glob("**/.ember-rank-*"))
    assert compile_cache.alias_rank("abc123/rank_0_0/backbone", "rank_1_0", tmp_path) == 0  # kept


def test_nothing_for_saves_own_rank_or_without_a_cache(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert compile_cache.alias_rank("abc123/rank_0_0/backbone", "rank_0_0", tmp_path) == 0
    assert compile_cache.alias_rank("", "rank_1_0", tmp_path) == 0
    assert compile_cache.alias_rank("abc/rank_0_0/x", "rank_1_0", tmp_path / "none") == 0
