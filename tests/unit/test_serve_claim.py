"""A transformers pod's `ember serve` runs the model and sizing its command names (the operator's
`ember serve --run-dir … --host … --port … <ember.contract.serve_args>`); its claims carry the same
arguments. An engine handed a claim with other arguments (a pod claimed for another deployment)
fails before it loads anything, and never serves."""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ember import contract, handoff
from ember.serving import server
from ember.serving.options import serve_options
from ember.serving.startup import ClaimRefused, EngineStarters, run_startup


def _pod_options(model: str, engine_args: list[str]) -> server.ServeOptions:
    """What the pod's command gives `ember serve` (operator/ember_operator/pods.py)."""
    command = ["--run-dir", contract.RUN_DIR, "--host", "0.0.0.0", "--port", str(contract.ENGINE_PORT),
               *contract.serve_args(model, engine_args)]
    options, unknown = serve_options(command)
    assert unknown == []
    return options


def test_the_claim_of_the_pods_own_arguments_is_served() -> None:
    args = ["--layers", "2", "--num-blocks", "32"]
    o = _pod_options("tiny-llama", args)
    assert server.claim_problem(o, contract.serve_args("tiny-llama", args)) == ""
    assert server.claim_problem(o, ()) == ""  # a claim that names none: nothing to compare


@pytest.mark.parametrize("claim", [
    contract.serve_args("other-model", ["--layers", "2", "--num-blocks", "32"]),
    contract.serve_args("tiny-llama", ["--layers", "3", "--num-blocks", "32"]),
    contract.serve_args("tiny-llama", ["--layers", "2"]),
    ["--served-model-name", "x"],  # not ember serve's
    ["--num-blocks", "many"],
])
def test_a_claim_of_other_arguments_is_refused(claim: list[str]) -> None:
    o = _pod_options("tiny-llama", ["--layers", "2", "--num-blocks", "32"])
    assert "belongs to another deployment's pool" in server.claim_problem(o, claim)


def test_model_arguments_of_engine_args_replace_the_model_name() -> None:
    assert contract.serve_args("Qwen/Qwen3-0.6B", []) == ["--model", "Qwen/Qwen3-0.6B"]
    assert contract.serve_args("Qwen/Qwen3-0.6B", ["--model", "/models/q"]) == ["--model", "/models/q"]
    assert contract.serve_args("Qwen/Qwen3-0.6B", ["--model-config=/c.json"]) == ["--model-config=/c.json"]


def _handed_off(run_dir: Path, engine_args: tuple[str, ...]) -> None:
    writer = handoff.HandoffWriter(run_dir)
    writer.fetching("id1", "file:///x")
    archive = writer.archive_dir("id1")
    archive.mkdir(parents=True)
    (archive / "manifest").write_text("{}")
    writer.ready("id1", archive, engine_args=engine_args)


def _starters(calls: list[str]) -> EngineStarters:
    def restore(archive_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
        calls.append("restore")
        return {"graphs": 1}, {"load": 0.1}

    def native() -> tuple[dict[str, Any], float]:
        calls.append("native")
        return {"graphs": 1}, 0.1

    def claim_problem(args: tuple[str, ...]) -> str:
        return "" if args == ("--mine",) else "not mine"

    return EngineStarters(restore, native, lambda: [1], claim_problem)


def test_the_start_checks_the_claims_engine_arguments_before_loading(tmp_path: Path) -> None:
    _handed_off(tmp_path / "a", ("--mine",))
    calls: list[str] = []
    assert run_startup(_starters(calls), run_dir=tmp_path / "a", deadline=5).mode == "restored"
    assert calls == ["restore"]

    _handed_off(tmp_path / "b", ("--theirs",))
    calls.clear()
    with pytest.raises(ClaimRefused, match="not mine"):
        run_startup(_starters(calls), run_dir=tmp_path / "b", deadline=5)
    assert calls == []
    state = handoff.read_engine_state(tmp_path / "b")
    assert state is not None and state["state"] == "failed" and "not mine" in state["reason"]


class _FakeCB:
    """CBEngine's surface `ember serve` starts (no torch)."""

    vocab_size = 32000

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return [1] * max_new_tokens


def test_ember_serve_restores_for_its_own_claim_and_fails_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real start-up wiring of `ember serve` (server → startup), the engine faked past the
    model build: the pod's own claim is restored, another deployment's fails before any LOAD."""
    from ember.engines.transformers_cb import adapter as cb_adapter
    from ember.engines.transformers_cb import engine as cb_engine
    from ember.serving.http import ServerState

    built: list[dict[str, Any]] = []
    restored: list[Path] = []
    monkeypatch.setattr(cb_adapter, "session", lambda mode: None)
    monkeypatch.setattr(cb_engine, "build_model", lambda **build: built.append(build) or "lm")
    monkeypatch.setattr(cb_engine, "CBEngine", _FakeCB)
    monkeypatch.setattr(cb_adapter, "restore_into", lambda engine, archive: restored.append(archive) or
                        types.SimpleNamespace(graphs=3, seconds={"load": 0.1}))
    args = ["--layers", "2", "--num-blocks", "32"]
    o = replace(_pod_options("tiny-llama", args), run_dir=tmp_path / "own", deadline=5)

    _handed_off(tmp_path / "own", tuple(contract.serve_args("tiny-llama", args)))
    state = ServerState(model_name="tiny-llama")
    server._start_engine(state, o)
    assert state.ready.is_set() and state.startup.mode == "restored" and len(restored) == 1
    assert built == [{"model": "tiny-llama", "model_config": None, "layers": 2, "seed": 0}]

    _handed_off(tmp_path / "other", tuple(contract.serve_args("other-model", args)))
    with pytest.raises(ClaimRefused, match="belongs to another deployment's pool"):
        server._start_engine(ServerState(model_name="tiny-llama"), replace(o, run_dir=tmp_path / "other"))
    assert len(restored) == 1
    state_file = handoff.read_engine_state(tmp_path / "other")
    assert state_file is not None and state_file["state"] == "failed"
