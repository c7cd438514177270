"""engine.args of engine.kind transformers: its pods and its SAVE Job run `ember serve` with them,
so what `ember serve` would refuse (unknown options, bad values) or what a pod's command owns
(`--host`, `--port`, `--run-dir`, `--no-handoff` …) would crash-loop its pods. The operator refuses
such a spec (phase Invalid with the message; CEL refuses the owned options at admission), and a
template cannot replace the engine's command."""

from __future__ import annotations

import re

import pytest
from operator_helpers import md_spec
from pydantic import ValidationError

from ember_operator import crdgen
from ember_operator.api_engine import POD_FLAGS, TRANSFORMERS_POD_FLAGS
from ember_operator.planning import validation_text

CB = {"kind": "transformers", "version": "5.17", "image": "engine:test"}


def _refusal(args: list[str]) -> str:
    with pytest.raises(ValidationError) as err:
        md_spec(engine={**CB, "args": args})
    return validation_text(err.value)


@pytest.mark.parametrize(("args", "message"), [
    (["--max-new-tokens", "256"], "engine.args: ['--max-new-tokens', '256'] are not `ember serve` options"),
    (["--served-model-name", "q"], "engine.args: ['--served-model-name', 'q'] are not `ember serve` options"),
    (["stray"], "engine.args: ['stray'] are not `ember serve` options"),
    (["--num-blocks", "many"], "engine.args: Invalid value for '--num-blocks'"),
    (["--num-blocks", "0"], "engine.args: Invalid value for '--num-blocks'"),
    (["--block-size"], "engine.args: Option '--block-size' requires an argument"),
    (["--port", "9000"], "engine.args: --port: the pod's command sets it (the Service targets port 8000)"),
    (["--host=127.0.0.1"], "engine.args: --host: the pod's command sets it"),
    (["--run-dir", "/x"], "engine.args: --run-dir: the pod's command sets it"),
    (["--no-handoff"], "engine.args: --no-handoff: a pod's engine always waits for the sidecar's hand-off"),
    (["--archive", "/a"], "engine.args: --archive: the sidecar hands the archive over"),
    (["--save-to", "file:///s"], "engine.args: --save-to: the SAVE Job saves, the pods serve"),
    (["--engine", "vllm"], "engine.args: --engine: engine.kind names the engine"),
    (["--no-preload"], "engine.args: --no-preload: a pod's engine always runs under libember"),
    (["--help"], "engine.args: --help: `ember serve` would print its help and exit"),
])
def test_engine_args_ember_serve_would_refuse_are_refused(args: list[str], message: str) -> None:
    text = _refusal(args)
    assert message in text and "engine.kind transformers" in text, text


@pytest.mark.parametrize("args", [
    [], ["--layers", "2", "--num-blocks", "32", "--block-size", "128"], ["--model", "tiny-llama"],
    ["--model-config=/models/shape.json", "--seed", "3"], ["--deadline", "60", "--max-tokens-limit", "256"],
])
def test_ember_serve_options_are_accepted(args: list[str]) -> None:
    assert md_spec(engine={**CB, "args": args}).engine.args == args


def test_vllm_args_are_vllms() -> None:
    vllm = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test", "args": ["--port", "9000", "--x"]}
    assert md_spec(engine=vllm).engine.args == ["--port", "9000", "--x"]


def _rules(node: object) -> list[dict[str, str]]:
    if isinstance(node, dict):
        return list(node.get("x-kubernetes-validations", [])) + [r for v in node.values() for r in _rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rules(v)]
    return []


def test_cel_refuses_at_admission_the_options_a_pod_owns() -> None:
    """Every option the operator refuses as the pod's is in the CRD's rule, spelled alone or with
    `=value`; other options (the operator parses them) pass it."""
    (rule,) = [r for r in _rules(crdgen.model_deployment_crd()) if r["message"] == TRANSFORMERS_POD_FLAGS]
    assert rule["rule"].startswith("self.kind != 'transformers' || !has(self.args) || self.args.all(")
    pattern = re.search(r"matches\('([^']+)'\)", rule["rule"])
    assert pattern is not None
    regex = re.compile(pattern.group(1))
    for flag in POD_FLAGS:
        assert regex.search(flag) and regex.search(f"{flag}=x"), flag
        assert f"engine.args: {flag}: " in _refusal([flag]), flag  # the operator refuses it too
    for other in ("--layers", "--hostname", "--port-x", "x--port", "--model"):
        assert not regex.search(other), other
    assert {"--host", "--port", "--run-dir", "--no-handoff", "--save-to", "--engine"} <= set(POD_FLAGS)


def test_a_template_cannot_replace_the_engines_command_or_args() -> None:
    rules = {r["rule"]: r["message"] for r in _rules(crdgen.model_deployment_crd())}
    message = rules["!has(self.command) && !has(self.args)"]
    assert message.startswith("the engine's command and args are ember's (`ember serve`")
    assert "give engine arguments in spec.engine.args" in message
    assert rules["!has(self.image)"] == "the engine's image is spec.engine.image"
