"""CPU, stand-ins for vLLM's compiled model: a TP > 1 archive's compiled code must read the
vocabulary bounds per rank. vLLM loads an AOT-compiled forward by its config, not by its code, so
code traced without ember's embedding patch (the bounds baked in as rank 0's) ran on every rank of
a TP=2 pod until the SAVE Job's sizing probe, which fills the cache SAVE loads, patched the model
too. SAVE now refuses code whose traced modules lack the patch and names it in its facts; LOAD
uses no TP > 1 archive that does not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.vllm import parallel


def _compiled(*modules: str) -> Any:
    """vLLM's `support_torch_compile` module with its AOT-compiled forward and torch's record of
    the sources it traced."""
    sources = [SimpleNamespace(module=m) for m in modules]  # torch keeps a set of InlinedSource
    fn = SimpleNamespace(source_info=lambda: SimpleNamespace(inlined_sources=sources))
    return SimpleNamespace(aot_compiled_fn=fn)


def _model(*children: Any) -> Any:
    return SimpleNamespace(modules=lambda: [SimpleNamespace(), *children])


VLLM = ("vllm.model_executor.models.llama", "vllm.model_executor.layers.vocab_parallel_embedding")


def test_the_modules_every_aot_compiled_forward_traced_are_collected() -> None:
    model = _model(_compiled(*VLLM), _compiled("ember.engines.vllm.parallel"))
    assert parallel.traced_modules(model) == {*VLLM, "ember.engines.vllm.parallel"}
    assert parallel.traced_modules(_model()) is None  # nothing AOT-compiled: nothing to read


def test_tp2_code_traced_without_the_patch_is_refused_and_with_it_accepted() -> None:
    unpatched, patched = _model(_compiled(*VLLM)), _model(_compiled(*VLLM, parallel.__name__))
    assert "without ember's vocabulary patch" in parallel.code_refusal(unpatched, 2)
    assert parallel.code_refusal(patched, 2) == ""
    assert parallel.code_refusal(unpatched, 1) == ""  # one rank: its own bounds are every rank's
    assert parallel.code_refusal(_model(), 2) == ""  # vLLM keys a non-AOT cache by the traced code
    unreadable = _model(SimpleNamespace(aot_compiled_fn=SimpleNamespace()))  # a torch without source_info
    assert "cannot tell which code" in parallel.code_refusal(unreadable, 2)


@pytest.mark.parametrize(("tensor", "facts", "refused"), [
    (2, {}, True),  # SAVEd before ember checked its code
    (2, {parallel.COMPILED_WITH: []}, True),
    (2, {parallel.COMPILED_WITH: [parallel.VOCAB_PATCH]}, False),
    (4, {parallel.COMPILED_WITH: [parallel.VOCAB_PATCH]}, False),
    (1, {}, False),
])
def test_load_uses_a_tp_archive_only_when_its_save_named_the_patch(tensor: int, facts: dict,
                                                                   refused: bool) -> None:
    assert bool(parallel.archive_refusal(tensor, facts)) is refused


@pytest.mark.parametrize(("probe", "patched"), [("1", True), ("0", False)])
def test_the_sizing_probe_builds_the_model_save_builds(probe: str, patched: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is vLLM without libember, but its compile fills the cache SAVE then loads: it
    must trace the patched embedding, or SAVE ships code with the probe's bounds baked in."""
    from ember.engines.vllm import plugin

    monkeypatch.setattr(plugin, "STATE", plugin._State())  # no EMBER_MODE: vLLM as it is
    monkeypatch.setenv("EMBER_VLLM_PROBE", probe)
    calls: list[Any] = []
    monkeypatch.setattr(plugin, "_parallel_before_model", calls.append)
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    plugin._before_runner(config, "v2")
    assert calls == ([config] if patched else [])
    assert not plugin.STATE.armed  # vLLM as it is otherwise: nothing armed, nothing refused
    assert not plugin.STATE.refusal


def test_load_refuses_a_tp_archive_without_the_record_before_placing_its_code(tmp_path, monkeypatch) -> None:
    """The runner's attached() runs before accept() and would put the archive's compiled code
    where vLLM loads it: it refuses first, and places nothing."""
    from ember.engines.vllm import compile_cache
    from ember.engines.vllm.adapter import VllmAdapter
    from ember.runtime.adapter import Refused

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "pod"))
    monkeypatch.delenv(compile_cache.PLACED, raising=False)
    unpacked: list[bool] = []
    monkeypatch.setattr(compile_cache, "unpack", lambda data: unpacked.append(True) or {"placed": 1})
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    adapter = VllmAdapter(vllm_config=config, runner_kind="v2")

    def archive(engine: dict) -> Any:
        return SimpleNamespace(manifest=SimpleNamespace(engine=engine), attachment=lambda name: b"caches")

    with pytest.raises(Refused, match="vocabulary bounds per rank"):
        adapter.attached(archive({}))
    assert unpacked == []
    adapter.report = lambda *a, **kw: None  # type: ignore[method-assign]
    adapter.attached(archive({parallel.COMPILED_WITH: [parallel.VOCAB_PATCH]}))
    assert unpacked == [True]
