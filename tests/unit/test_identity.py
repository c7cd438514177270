"""The archive identity covers the model's configuration, and LOAD refuses another shape."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

from ember.identity import ArchiveIdentity, canonical_json, config_digest
from ember.runtime.adapter import COMPAT, Refused
from ember.runtime.load import load

MISTRAL = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "rope_theta": 10000.0, "sliding_window": 4096, "dtype": "bfloat16",
    "_name_or_path": "/models/mistral", "transformers_version": "5.17.0",
}


def _identity(**kw: Any) -> ArchiveIdentity:
    return ArchiveIdentity(model="m", engine="transformers-cb", engine_version="5.17.0",
                           capture_sizes=(1, 2), **kw)


@pytest.mark.parametrize("change", [
    {"num_hidden_layers": 16}, {"num_key_value_heads": 4}, {"sliding_window": None},
    {"rope_theta": 1e6}, {"dtype": "float16"}, {"architectures": ["LlamaForCausalLM"]},
])
def test_every_shape_setting_changes_the_digest(change: dict[str, Any]) -> None:
    assert config_digest({**MISTRAL, **change}) != config_digest(MISTRAL)


def test_a_name_path_or_version_does_not() -> None:
    renamed = {**MISTRAL, "_name_or_path": "/elsewhere", "transformers_version": "5.18.0"}
    assert config_digest(renamed) == config_digest(MISTRAL)


def test_two_shapes_under_one_name_get_two_identities() -> None:
    a, b = (_identity(config=config_digest(c)) for c in (MISTRAL, {**MISTRAL, "num_hidden_layers": 8}))
    assert a.hash() != b.hash()


def test_an_identity_without_a_digest_keeps_its_hash() -> None:
    """The operator never reads a model: its identities (and archives named by them) keep the
    hash they had before the field existed; so do those without engine arguments or an image
    digest or workload settings (fields added later)."""
    ident = _identity()
    later = ("config", "engine_args", "image_digest", "workload")
    before = {k: v for k, v in ident.model_dump(mode="json").items() if k not in later}
    assert ident.hash() == hashlib.sha256(canonical_json(before)).hexdigest()
    assert _identity(engine_args=("--enforce-eager",)).hash() != ident.hash()
    assert _identity(image_digest="sha256:" + "0" * 64).hash() != ident.hash()
    assert _identity(workload={"layers": "2"}).hash() != ident.hash()


class _Adapter:
    """An engine whose model has `digest`; it must not be asked to install anything."""

    kind = "test"

    def __init__(self, digest: str) -> None:
        self.digest, self.installed = digest, False

    def config_digest(self) -> str:
        return self.digest

    def prepare(self, facts: Any) -> None:
        pass

    def install(self, library: Any, archive: Any) -> int:
        self.installed = True
        return 0


class _Restore:
    def __init__(self, facts: dict[str, Any]) -> None:
        self.manifest = SimpleNamespace(engine=facts)
        self.abandoned = False
        self.ip = SimpleNamespace(divergence=lambda: "")

    def abandon(self) -> None:
        self.abandoned = True


def test_load_refuses_an_archive_of_another_model_shape_before_anything_is_installed() -> None:
    other = config_digest({**MISTRAL, "num_hidden_layers": 8})
    adapter, restore = _Adapter(config_digest(MISTRAL)), _Restore({"config": other})
    with pytest.raises(Refused) as err:
        load(adapter, restore)  # type: ignore[arg-type]
    assert err.value.stage == COMPAT and "model configuration differs" in err.value.reason
    assert restore.abandoned and not adapter.installed
