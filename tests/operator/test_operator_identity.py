"""Archive identity derivation from a ModelDeployment spec."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import md_spec

from ember import contract
from ember.contract import Claim
from ember.identity import digest_short, identity_short
from ember.identity_args import graph_args
from ember_operator import naming
from ember_operator.api import CaptureSpec, IdentitySpec


def test_identity_is_stable_and_ignores_scaling_fields() -> None:
    a = md_spec(replicas=1)
    b = md_spec(replicas=7, warmPool={"size": 3})
    assert a.identity().hash() == b.identity().hash()


def test_parallelism_and_gpu_change_the_identity() -> None:
    base = md_spec().identity().hash()
    ep = md_spec(parallelism={"data": 2, "expert": 2}, gpu={"product": "NVIDIA-H100-80GB-HBM3", "count": 2})
    other_gpu = md_spec(gpu={"product": "NVIDIA-H200"})
    assert ep.identity().hash() != base
    assert other_gpu.identity().hash() != base
    assert ep.identity().parallelism.expert == 2


def test_presets_resolve_to_sizes() -> None:
    assert CaptureSpec(preset="small", max_batch=4).resolved_sizes() == (1, 2, 4)
    assert CaptureSpec(preset="powers-of-two", max_batch=40).resolved_sizes() == (1, 2, 4, 8, 16, 32)
    default = CaptureSpec(max_batch=512).resolved_sizes()
    assert default[:4] == (1, 2, 4, 8) and default[-1] == 512 and list(default) == sorted(default)


def test_identity_spec_round_trips() -> None:
    ident = md_spec().identity()
    assert IdentitySpec.of(ident).to_identity() == ident
    assert IdentitySpec.of(ident).to_identity().hash() == ident.hash()


def _engine(**over: Any) -> dict[str, Any]:
    return {"kind": "vllm", "version": "0.26.0", "image": "engine:test", **over}


BASE_ARGS = ["--max-model-len", "4096"]


@pytest.mark.parametrize("args", [
    [*BASE_ARGS, "--quantization", "fp8"],
    [*BASE_ARGS, "--kv-cache-dtype", "fp8_e5m2"],
    ["--max-model-len", "8192"],
    [*BASE_ARGS, "--enforce-eager"],
    [*BASE_ARGS, "--block-size", "32"],
    [*BASE_ARGS, "--max-num-seqs", "64"],
    [*BASE_ARGS, "--compilation-config", '{"level": 0}'],
    [*BASE_ARGS, "--gpu-memory-utilization", "0.8"],
    [*BASE_ARGS, "--some-future-flag"],  # unknown: identity (one extra SAVE at worst)
])
def test_every_graph_argument_changes_the_identity(args: list[str]) -> None:
    base = md_spec(engine=_engine(args=BASE_ARGS)).identity()
    changed = md_spec(engine=_engine(args=args)).identity()
    assert changed.hash() != base.hash()


@pytest.mark.parametrize("args", [
    [*BASE_ARGS, "--port", "9000", "--host", "127.0.0.1"],
    [*BASE_ARGS, "--served-model-name", "qwen", "--api-key=secret", "--disable-log-stats"],
    [*BASE_ARGS, "--no-disable-log-stats", "--uvicorn-log-level", "debug", "--tokenizer", "x/y"],
    ["--max_model_len=4096"],  # another spelling of the same
    ["--port", "1", "--max-model-len", "4096", "--enable-auto-tool-choice"],
])
def test_arguments_that_do_not_change_graphs_keep_it(args: list[str]) -> None:
    base = md_spec(engine=_engine(args=BASE_ARGS)).identity()
    assert md_spec(engine=_engine(args=args)).identity().hash() == base.hash()


def test_ember_serve_serving_knobs_keep_a_transformers_identity_its_sizing_does_not() -> None:
    def ident(*args: str) -> str:
        engine = {"kind": "transformers", "version": "5.17", "image": "engine:test", "args": list(args)}
        return md_spec(engine=engine).identity().hash()

    base = ident("--num-blocks", "128")
    assert ident("--num-blocks", "128", "--deadline", "60", "--max-tokens-limit", "64") == base
    assert ident("--num-blocks", "256") != base
    assert ident("--num-blocks", "128", "--layers", "2") != base


def test_canonical_arguments_keep_values_and_repeated_flags_in_order() -> None:
    args = ["--b", "1", "2", "--a", "--port", "1", "--b=3", "--c", "--host"]
    assert graph_args(args) == ("--a", "--b", "1", "2", "--b", "3", "--c")
    assert graph_args(["model-x", "--a"]) == ("model-x", "--a")


def test_a_pinned_image_digest_changes_the_identity_a_tag_does_not() -> None:
    d1, d2 = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    base = md_spec(engine=_engine(image="registry/engine:0.26")).identity()
    assert base.image_digest == ""
    assert md_spec(engine=_engine(image="registry/engine:0.27")).identity().hash() == base.hash()
    pinned = md_spec(engine=_engine(image=f"registry/engine:0.26@{d1}")).identity()
    assert pinned.image_digest == d1 and pinned.hash() != base.hash()
    moved = md_spec(engine=_engine(image=f"mirror.local/engine@{d1}")).identity()
    assert moved.hash() == pinned.hash()  # the same bytes under another name
    assert md_spec(engine=_engine(image=f"registry/engine@{d2}")).identity().hash() != pinned.hash()


def test_identities_without_args_or_digest_keep_their_hash() -> None:
    ident = md_spec().identity()
    assert "engine_args" not in ident.canonical() and "image_digest" not in ident.canonical()
    with_args = md_spec(engine=_engine(args=BASE_ARGS)).identity()
    assert with_args.canonical()["engine_args"] == BASE_ARGS
    assert IdentitySpec.of(with_args).to_identity().hash() == with_args.hash()


def test_a_vllm_identity_names_how_ember_compiles_it_through_the_grapharchive() -> None:
    """An archive compiled before Inductor's deterministic mode is not found under it: the vLLM
    identity names the mode, and the GraphArchive's spec keeps it for the SAVE Job's hash check."""
    from ember.engines.vllm.args import IDENTITY_WORKLOAD

    vllm = md_spec(engine=_engine()).identity()
    assert vllm.workload == IDENTITY_WORKLOAD
    assert IdentitySpec.of(vllm).to_identity().hash() == vllm.hash()
    assert vllm.hash() != vllm.model_copy(update={"workload": {}}).hash()


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_an_identity_names_its_engines_canary_kind(engine: str) -> None:
    """LOAD refuses an archive whose canary is of another kind than its own: the kind is identity,
    so an ember whose canary changed finds no archive under the old identity and SAVEs again
    instead of every pod refusing the old one."""
    from ember.engines.transformers_cb import canary as cb_canary
    from ember.engines.vllm import canary as vllm_canary

    ident = (md_spec(engine=_engine()) if engine == "vllm" else md_spec()).identity()
    assert ident.engine == engine
    kind = (vllm_canary if engine == "vllm" else cb_canary).KIND
    assert ident.workload["canary"] == kind
    assert IdentitySpec.of(ident).to_identity().hash() == ident.hash()
    other = ident.model_copy(update={"workload": {**ident.workload, "canary": kind + "-before"}})
    assert other.hash() != ident.hash()


def test_names_and_labels_keep_the_first_16_hex_of_the_identity_hash() -> None:
    """`ga-<16>`, `ember-save-<16>-<n>` and the identity label are API: `identity_short` keeps them."""
    h = md_spec().identity().hash()
    claim = Claim(archive_uri=f"s3://b/archives/{h}/manifest", identity=h)
    assert naming.archive_name(h) == f"ga-{h[:16]}"
    assert naming.save_job_name(h, 2) == f"ember-save-{h[:16]}-2"
    assert claim.labels()[contract.LABEL_IDENTITY] == h[:16] == identity_short(h) == digest_short(h)
