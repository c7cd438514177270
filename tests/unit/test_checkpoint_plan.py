# ruff: noqa: E501  (checkpoint tensor names read better unwrapped)
"""`--model DIR`: which checkpoint tensors fill which workload parameter (no torch needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.engines.decode.checkpoint import CheckpointError, plan


def _spec(**kw: object) -> SimpleNamespace:
    base = {"layers": 2, "sandwich_norms": False, "qk_norm": False, "experts": 0}
    return SimpleNamespace(**{**base, **kw})


def _llama_names(layers: int, prefix: str = "model.", head: bool = True) -> list[str]:
    names = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"] + (["lm_head.weight"] if head else [])
    for i in range(layers):
        a, m = f"{prefix}layers.{i}.self_attn.", f"{prefix}layers.{i}.mlp."
        names += [f"{a}{p}_proj.weight" for p in "qkvo"]
        names += [f"{m}{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{prefix}layers.{i}.input_layernorm.weight", f"{prefix}layers.{i}.post_attention_layernorm.weight"]
    return names


def test_llama_checkpoint_fills_fused_projections_in_order() -> None:
    p = plan(_llama_names(2), _spec())
    assert p["layers.1.qkv.weight"] == (
        "cat",
        ("layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight"),
    )
    assert p["layers.0.gu.weight"] == ("cat", ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"))
    assert p["head.weight"] == ("copy", ("lm_head.weight",))
    assert p["layers.0.n2"] == ("copy", ("layers.0.post_attention_layernorm.weight",))
    assert len(p) == 3 + 2 * 6


def test_tied_embeddings_fill_the_head() -> None:
    assert plan(_llama_names(1, head=False), _spec(layers=1))["head.weight"] == ("copy", ("embed_tokens.weight",))


def test_gemma_norms_are_offset_and_nested_prefix_is_stripped() -> None:
    names = _llama_names(1, prefix="language_model.model.")
    names += [
        f"language_model.model.layers.0.{n}.weight"
        for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")
    ]
    p = plan(names, _spec(layers=1, sandwich_norms=True, qk_norm=True))
    assert p["layers.0.n1_post"] == ("plus1", ("layers.0.post_attention_layernorm.weight",))
    assert p["layers.0.n2"] == ("plus1", ("layers.0.pre_feedforward_layernorm.weight",))
    assert p["layers.0.qn"] == ("plus1", ("layers.0.self_attn.q_norm.weight",))
    assert p["norm"] == ("plus1", ("norm.weight",))


def test_moe_experts_are_concatenated_and_transposed_per_expert() -> None:
    names = [n for n in _llama_names(1) if ".mlp." not in n] + ["model.layers.0.mlp.gate.weight"]
    names += [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up", "down")]
    p = plan(names, _spec(layers=1, experts=3))
    assert p["layers.0.w_gu#2"] == (
        "cat_t",
        ("layers.0.mlp.experts.2.gate_proj.weight", "layers.0.mlp.experts.2.up_proj.weight"),
    )
    assert p["layers.0.w_d#0"] == ("t", ("layers.0.mlp.experts.0.down_proj.weight",))
    assert p["layers.0.router.weight"] == ("copy", ("layers.0.mlp.gate.weight",))


def test_a_missing_tensor_is_named() -> None:
    names = [n for n in _llama_names(2) if n != "model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(CheckpointError, match=r"no tensor layers\.1\.mlp\.down_proj\.weight"):
        plan(names, _spec())
    with pytest.raises(CheckpointError, match="more"):
        plan(_llama_names(1), _spec(layers=3))  # a config with more layers than the weights
