"""`ember save --job`: one entry for every engine, the SAVE Job contract kept on every failure
(the reason in the termination log, exit 1), the identity's engine choosing the SAVE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember import contract
from ember.cli import app
from ember.identity import ArchiveIdentity, Parallelism


def _identity(engine: str, **par: int) -> str:
    return ArchiveIdentity(model="Qwen/Qwen3-0.6B", engine=engine, engine_version="0.26.0",
                           capture_sizes=(1, 8), parallelism=Parallelism(**par)).model_dump_json()


def _job(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str]:
    log = tmp_path / "termination-log"
    env = {contract.ENV_TERMINATION_LOG: str(log), **env}
    result = CliRunner().invoke(app, ["save", "--job", "--", *args], env=env)
    return result.exit_code, log.read_text() if log.exists() else ""


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (contract.ENV_IDENTITY, contract.ENV_STORE):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("env", "reason"), [
    ({}, "EMBER_IDENTITY is not set"),
    ({"EMBER_IDENTITY": "{not json"}, "EMBER_IDENTITY is not an archive identity"),
    ({"EMBER_IDENTITY": json.dumps({"model": "m"})}, "EMBER_IDENTITY is not an archive identity"),
    ({"EMBER_IDENTITY": _identity("vllm")}, "EMBER_STORE is not set"),
    ({"EMBER_IDENTITY": _identity("sglang"), "EMBER_STORE": "file:///tmp/x"},
     "engine 'sglang' has no SAVE Job here (known: ember-decode, transformers, vllm)"),
])
def test_a_job_that_cannot_run_says_why_in_the_termination_log(tmp_path: Path, env: dict[str, str],
                                                               reason: str) -> None:
    code, log = _job(tmp_path, env)
    assert code == 1
    assert log.startswith("SAVE failed: JobFailed: ") and reason in log, log


def test_the_identity_engine_picks_the_save(tmp_path: Path) -> None:
    """A vLLM identity reaches vLLM's job (which refuses a rank outside the identity's world
    before starting any engine); a decode identity refuses engine arguments, which only vLLM takes."""
    store = {"EMBER_STORE": (tmp_path / "store").as_uri()}
    env = {"EMBER_IDENTITY": _identity("vllm", tensor=2), "EMBER_VLLM_SAVE_RANK": "2", **store}
    code, log = _job(tmp_path, env)
    assert code == 1 and "EMBER_VLLM_SAVE_RANK=2 is not a rank of a world of 2" in log, log
    code, log = _job(tmp_path, {"EMBER_IDENTITY": _identity("ember-decode"), **store}, "--enforce-eager")
    assert code == 1 and "ember-decode takes no engine arguments" in log, log


def test_engine_arguments_outside_a_job_are_refused() -> None:
    result = CliRunner().invoke(app, ["save", "--prove-only", "--", "--enforce-eager"])
    assert result.exit_code == 2 and "unexpected arguments" in result.output
