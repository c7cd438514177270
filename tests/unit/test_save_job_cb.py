"""The transformers SAVE Job (`ember save --job` for engine `transformers`): the deployment's
engine arguments read as `ember serve` options, checked with the identity before anything starts,
and the SAVE of `ember serve --save-to` run under the identity the Job was given. CPU: the engine
is faked past the arguments (tests/gpu/test_cb_save_job.py runs the real one)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ember import contract
from ember.cli import app, save_job
from ember.engines.transformers_cb import adapter as cb_adapter
from ember.engines.transformers_cb import engine as cb_engine
from ember.engines.transformers_cb import hooks
from ember.identity import ArchiveIdentity, Parallelism
from ember.runtime import session
from ember.serving import server
from ember.serving.options import serve_options

VERSION = "5.17.0"


def _identity(model: str = "tiny-llama", **over: Any) -> ArchiveIdentity:
    fields: dict[str, Any] = {"model": model, "engine": "transformers", "engine_version": VERSION,
                              "capture_sizes": (1, 2, 4, 8), "gpu_product": "NVIDIA-H100-80GB-HBM3"}
    return ArchiveIdentity(**{**fields, **over})


@pytest.fixture(autouse=True)
def _installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers VERSION in the engine image (not installed on CPU test machines)."""
    monkeypatch.setattr(hooks, "engine_version", lambda: VERSION)
    for name in (contract.ENV_IDENTITY, contract.ENV_IDENTITY_HASH, contract.ENV_STORE):
        monkeypatch.delenv(name, raising=False)


def _job(tmp_path: Path, identity: ArchiveIdentity, *args: str, **env: str) -> tuple[int, str]:
    log = tmp_path / "termination-log"
    env = {contract.ENV_TERMINATION_LOG: str(log), contract.ENV_IDENTITY: identity.model_dump_json(),
           contract.ENV_STORE: (tmp_path / "store").as_uri(), **env}
    result = CliRunner().invoke(app, ["save", "--job", "--", *args], env=env)
    return result.exit_code, log.read_text() if log.exists() else ""


def test_engine_arguments_are_ember_serve_options_and_the_identity_names_the_model() -> None:
    o = save_job.transformers_options(_identity(), ["--layers", "2", "--num-blocks", "32", "--block-size",
                                                    "128", "--seed", "3"])
    assert (o.model, o.layers, o.seed) == ("tiny-llama", 2, 3)
    assert server.engine_sizing(o) == {"block_size": 128, "num_blocks": 32, "max_batch_tokens": 1024,
                                       "max_requests_per_batch": 64, "q_padding_interval_size": 256,
                                       "kv_padding_interval_size": 4096}


def test_arguments_that_name_a_model_come_before_the_identity(tmp_path: Path) -> None:
    config = tmp_path / "shape.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    o = save_job.transformers_options(_identity("Qwen/Qwen3-0.6B"), ["--model-config", str(config)])
    assert o.model is None and o.model_config == config
    o = save_job.transformers_options(_identity("Qwen/Qwen3-0.6B"), ["--model", "tiny-llama"])
    assert o.model == "tiny-llama"


def test_the_job_parses_as_ember_serve_does(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--model", "tiny-llama", "--num-blocks", "32", "--no-handoff", "--kv-interval", "2048"]
    seen: list[server.ServeOptions] = []
    monkeypatch.setattr(server, "run", lambda o, extra=(): seen.append(o) or 0)
    assert CliRunner().invoke(app, ["serve", *args]).exit_code == 0
    assert seen == [serve_options(args)[0]]


@pytest.mark.parametrize(("identity", "args", "reason"), [
    (_identity(), ["--max-new-tokens", "256"],
     "engine.args: ['--max-new-tokens', '256'] are not `ember serve` options"),
    (_identity(), ["--num-blocks", "many"], "engine.args: Invalid value for '--num-blocks'"),
    (_identity(), ["--block-size"], "engine.args: Option '--block-size' requires an argument"),
    (_identity(), ["--num-blocks", "0"], "engine.args: Invalid value for '--num-blocks'"),
    (_identity(), ["--save-to", "file:///elsewhere"], "engine.args: --save-to: the SAVE Job saves"),
    (_identity(), ["--engine", "vllm"], "engine.args: --engine: engine.kind names the engine"),
    (_identity(), ["--host", "0.0.0.0"], "engine.args: --host: the pod's command sets it"),
    (_identity("Qwen/Qwen3-0.6B"), [], "no model to build: unknown model 'Qwen/Qwen3-0.6B'"),
    (_identity(), ["--model-config", "/nonexistent/shape.json"], "no model to build: "),
    (_identity(parallelism=Parallelism(tensor=2)), [], "no SAVE of a parallel shape (tensor 2, expert 1"),
    (_identity(dtype="float16"), [], "dtype float16: `ember serve` builds bfloat16 models"),
    (_identity(engine_version="4.57.0"), [],
     "the identity names transformers 4.57.0, the engine image has 5.17.0"),
])
def test_what_cannot_be_saved_is_a_reason_before_anything_starts(
    tmp_path: Path, identity: ArchiveIdentity, args: list[str], reason: str
) -> None:
    code, log = _job(tmp_path, identity, *args)
    assert code == 1 and log.startswith("SAVE failed: JobFailed: ") and reason in log, log


def test_an_engine_version_the_deployment_pins_short_names_the_installed_one() -> None:
    assert save_job.transformers_options(_identity(engine_version="5.17"), []).model == "tiny-llama"


def test_an_image_without_transformers_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "engine_version", lambda: None)
    code, log = _job(tmp_path, _identity())
    assert code == 1 and "transformers is not installed in the engine image" in log, log


def test_an_identity_that_is_not_the_operators_name_is_refused(tmp_path: Path) -> None:
    """EMBER_IDENTITY_HASH is the name the operator gave the archive: its pods look there."""
    code, log = _job(tmp_path, _identity(), **{contract.ENV_IDENTITY_HASH: "ab" * 32})
    assert code == 1 and "hashes to" in log and "abababababababab" in log, log


def test_no_gpu_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "reexec_under_libember", lambda mode: None)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    code, log = _job(tmp_path, _identity())
    assert code == 1 and "no CUDA GPU visible" in log, log


def _fake_save(monkeypatch: pytest.MonkeyPatch, published: bool = True) -> list[tuple[Any, ...]]:
    """The SAVE past the arguments: re-exec, GPU and `server.save` recorded, nothing run."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(session, "reexec_under_libember", lambda mode: calls.append(("reexec", mode)))
    monkeypatch.setattr(save_job, "_need_gpu", lambda: None)

    def save(o: server.ServeOptions, store: str, identity: ArchiveIdentity) -> Any:
        calls.append(("save", o, store, identity))
        summary = {"identity": identity.hash(), "manifest": f"{store}/archives/{identity.hash()}/manifest",
                   "published": published}
        return types.SimpleNamespace(published=published, reason="" if published else "not published: no",
                                     summary=lambda: summary)

    monkeypatch.setattr(server, "save", save)
    return calls


def test_the_job_saves_under_the_identity_it_was_given(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_save(monkeypatch)
    ident = _identity(engine_args=("--layers", "2"))
    code, log = _job(tmp_path, ident, "--layers", "2", **{contract.ENV_IDENTITY_HASH: ident.hash()})
    assert code == 0, log
    assert calls[0] == ("reexec", "save")
    _, options, store, identity = calls[1]
    assert identity == ident and store == (tmp_path / "store").as_uri()
    assert (options.model, options.layers) == ("tiny-llama", 2)
    assert json.loads(log)["identity"] == ident.hash()


def test_an_archive_not_published_fails_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_save(monkeypatch, published=False)
    code, log = _job(tmp_path, _identity())
    assert code == 1 and log == "SAVE failed: JobFailed: not published: no", log


def test_serve_save_hands_the_identity_to_the_engine_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ember serve --save-to` and the Job share `server.save`: same model, same sizing; the
    Job's identity goes to the adapter, which publishes under it."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cb_adapter, "session", lambda mode: seen.setdefault("session", mode))
    monkeypatch.setattr(cb_engine, "build_model", lambda **build: seen.setdefault("build", build))
    monkeypatch.setattr(cb_engine, "generation_config", lambda: "gen")

    def save_engine(model: Any, gen: Any, sizing: dict[str, Any], store: str, name: str, ip: Any,
                    *, identity: ArchiveIdentity | None = None) -> tuple[str, None]:
        seen.update(sizing=sizing, store=store, name=name, identity=identity)
        return "outcome", None

    monkeypatch.setattr(cb_adapter, "save_engine", save_engine)
    o = serve_options(["--model", "tiny-llama", "--layers", "2", "--num-blocks", "16"])[0]
    ident = _identity()
    assert server.save(o, "file:///store", ident) == "outcome"
    assert seen["session"] == "save" and seen["identity"] is ident and seen["name"] == "tiny-llama"
    assert seen["build"] == {"model": "tiny-llama", "model_config": None, "layers": 2, "seed": 0}
    assert seen["sizing"] == server.engine_sizing(o) and seen["sizing"]["num_blocks"] == 16


def test_the_adapter_names_the_archive_by_the_identity_it_was_given() -> None:
    ident = _identity()
    assert cb_adapter.CBEngineAdapter(identity=ident).identity() is ident
