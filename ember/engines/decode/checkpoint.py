"""Weights from a local transformers checkpoint for a decode workload (`--model DIR`).

The directory holds `config.json` (the shape, read by `model.spec_from_hf_config`) and
`*.safetensors`. The decode step stays ember's own implementation of the architecture (Llama,
Qwen3, Qwen3-MoE, Gemma-3 families); the checkpoint supplies its weights. `plan()` maps the
checkpoint's tensor names to the workload's parameters without torch (CPU-testable);
`load_into()` copies them in. Weights are copied from host tensors into parameters that already
exist, so loading allocates no device memory and SAVE and LOAD keep the same allocation sequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.engines.decode.model import ModelSpec

# Multimodal checkpoints (Gemma-3) nest the text model.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")

# (how, checkpoint names): "copy", "cat" (along dim 0), "cat_t" (cat, then transpose: HF keeps
# [out, in] per expert, the workload [in, out] for all experts), "t", "plus1" (Gemma norms
# store w - 1).
Step = tuple[str, tuple[str, ...]]


class CheckpointError(ValueError):
    """The checkpoint does not provide what the workload needs; the message names it."""


def _short(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def plan(names: Iterable[str], spec: ModelSpec) -> dict[str, Step]:
    """Workload parameter name → how to fill it from the checkpoint's tensors (by short name)."""
    have = {_short(n) for n in names}
    norm = "plus1" if spec.sandwich_norms else "copy"  # Gemma stores norm weights as w - 1
    out: dict[str, Step] = {
        "emb.weight": ("copy", ("embed_tokens.weight",)),
        "norm": (norm, ("norm.weight",)),
    }
    out["head.weight"] = (
        "copy",
        ("lm_head.weight",) if "lm_head.weight" in have else ("embed_tokens.weight",),
    )
    for i in range(spec.layers):
        a, m, L = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"layers.{i}."
        out[f"{L}qkv.weight"] = ("cat", (f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"))
        out[f"{L}o.weight"] = ("copy", (f"{a}o_proj.weight",))
        if spec.sandwich_norms:
            out[f"{L}n1"] = (norm, (f"{L}input_layernorm.weight",))
            out[f"{L}n1_post"] = (norm, (f"{L}post_attention_layernorm.weight",))
            out[f"{L}n2"] = (norm, (f"{L}pre_feedforward_layernorm.weight",))
            out[f"{L}n2_post"] = (norm, (f"{L}post_feedforward_layernorm.weight",))
        else:
            out[f"{L}n1"] = (norm, (f"{L}input_layernorm.weight",))
            out[f"{L}n2"] = (norm, (f"{L}post_attention_layernorm.weight",))
        if spec.qk_norm:
            out[f"{L}qn"] = (norm, (f"{a}q_norm.weight",))
            out[f"{L}kn"] = (norm, (f"{a}k_norm.weight",))
        if spec.experts:
            out[f"{L}router.weight"] = ("copy", (f"{m}gate.weight",))
            for e in range(spec.experts):
                x = f"{m}experts.{e}."
                out[f"{L}w_gu#{e}"] = ("cat_t", (f"{x}gate_proj.weight", f"{x}up_proj.weight"))
                out[f"{L}w_d#{e}"] = ("t", (f"{x}down_proj.weight",))
        else:
            out[f"{L}gu.weight"] = ("cat", (f"{m}gate_proj.weight", f"{m}up_proj.weight"))
            out[f"{L}d.weight"] = ("copy", (f"{m}down_proj.weight",))
    missing = sorted({n for _, srcs in out.values() for n in srcs} - have)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint has no tensor {', '.join(missing[:5])}{more}")
    return out


def tensor_names(model_dir: str | Path) -> dict[str, Path]:
    """Every tensor name in the directory's *.safetensors files → its file."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update(dict.fromkeys(st.keys(), f))
    return out


def load_into(model: Any, model_dir: str | Path, spec: ModelSpec) -> int:
    """Copy the checkpoint's weights into `model` (a model.DecodeModel); returns tensors read."""
    import torch
    from safetensors import safe_open

    where = tensor_names(model_dir)
    by_short = {_short(n): n for n in where}
    steps = plan(where, spec)
    params = dict(model.named_parameters())
    handles: dict[Path, Any] = {}

    def get(short: str) -> torch.Tensor:
        name = by_short[short]
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name)

    read = 0
    with torch.no_grad():
        for target, (how, srcs) in steps.items():
            parts = [get(s) for s in srcs]
            read += len(parts)
            if how == "cat":
                value = torch.cat(parts, 0)
            elif how == "cat_t":
                value = torch.cat(parts, 0).t()
            elif how == "t":
                value = parts[0].t()
            elif how == "plus1":
                value = parts[0].float() + 1.0
            else:
                value = parts[0]
            name, _, expert = target.partition("#")
            dest = params[name][int(expert)] if expert else params[name]
            if tuple(dest.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{', '.join(srcs)}: shape {tuple(value.shape)} does not fit {name} {tuple(dest.shape)}"
                )
            dest.copy_(value.to(dest.dtype))
    return read
