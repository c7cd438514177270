"""`ember serve`'s options, declared once (the command's typer signature, `serve`): the command
line (ember.cli registers `serve`), the SAVE Job of a transformers deployment and the operator
(admission of its `engine.args`) all read arguments with them (`serve_options`, `pod_options`).

Light on purpose: typer and the pod contract only (no torch, no transformers, not the server,
which `serve` imports when it runs), so the operator imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

import typer

from ember import contract

# Arguments it does not know are kept: `--engine vllm` passes them on to `vllm serve`.
CONTEXT_SETTINGS: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True}


class UsageError(ValueError):
    """The options cannot serve (the command line says so, exit 2)."""


@dataclass(frozen=True)
class ServeOptions:
    """`ember serve`'s options (`serve` declares them)."""

    model: str | None = None
    model_config: Path | None = None
    layers: int | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = contract.ENGINE_PORT
    run_dir: Path | None = None
    use_handoff: bool = True
    deadline: float = 30.0
    archive: Path | None = None
    num_blocks: int = 64
    block_size: int = 256
    max_batch_tokens: int = 1024
    max_requests: int = 64
    q_interval: int = 256
    kv_interval: int = 4096
    max_tokens_limit: int = 512
    save_to: str | None = None
    preload: bool = True
    engine_kind: str = "transformers"


def _count(help_text: str) -> Any:
    return typer.Option(min=1, help=help_text)


# long: typer declares every option in the signature; the body is one call
def serve(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(help="Built-in shape (llama-3-8b, qwen3-8b, tiny-llama) or a local checkpoint dir."),
    ] = None,
    model_config: Annotated[
        Path | None, typer.Option(help="transformers config JSON: random weights.")
    ] = None,
    layers: Annotated[int | None, _count("Override the number of layers.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    host: Annotated[str, typer.Option(help="Listen address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port.")] = contract.ENGINE_PORT,
    run_dir: Annotated[Path | None, typer.Option(help="Sidecar run dir (EMBER_RUN_DIR).")] = None,
    use_handoff: Annotated[bool, typer.Option("--handoff/--no-handoff", help="Wait for the sidecar.")] = True,
    deadline: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for the archive after the claim.")
    ] = 30.0,
    archive: Annotated[
        Path | None, typer.Option(help="LOAD this archive dir (…/archives/<hash>) directly, no sidecar.")
    ] = None,
    num_blocks: Annotated[int, _count("KV-cache blocks (native start).")] = 64,
    block_size: Annotated[int, _count("Tokens per KV-cache block.")] = 256,
    max_batch_tokens: Annotated[int, _count("Token budget per batch.")] = 1024,
    max_requests: Annotated[int, _count("Requests per batch.")] = 64,
    q_interval: Annotated[int, _count("Query padding interval (graph keys).")] = 256,
    kv_interval: Annotated[int, _count("KV padding interval (graph keys).")] = 4096,
    max_tokens_limit: Annotated[int, _count("Largest max_tokens a request may ask.")] = 512,
    save_to: Annotated[
        str | None, typer.Option(help="SAVE this engine's graphs to a store URI, print the summary, exit.")
    ] = None,
    preload: Annotated[
        bool, typer.Option("--preload/--no-preload", help="Re-run under libember (SAVE/LOAD need it).")
    ] = True,
    engine_kind: Annotated[
        str,
        typer.Option("--engine", envvar=contract.ENV_ENGINE,
                     help="transformers (this server) or vllm (`vllm serve` + plugin); pods set it."),
    ] = "transformers",
) -> None:
    """Serve a model over HTTP (OpenAI-style) with transformers continuous batching: restored graphs
    from the sidecar's archive, or native capture on any refusal. Ready only after the first token.
    `--engine vllm -- <vllm serve args>`: supervise `vllm serve` behind the same hand-off."""
    from ember.serving import server

    opts = {k: v for k, v in locals().items() if k not in ("ctx", "server")}
    try:
        code = server.run(ServeOptions(**opts), ctx.args)
    except UsageError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code)


@functools.cache
def _command() -> Any:
    """The command `serve` declares (click's, built once: parsing never changes it)."""
    app = typer.Typer(context_settings=CONTEXT_SETTINGS)
    app.command()(serve)
    return typer.main.get_command(app)


def serve_options(args: Sequence[str]) -> tuple[ServeOptions, list[str]]:
    """`args` parsed as `ember serve`'s command line: its options, and the arguments it does not
    know. UsageError with the command's message for a value it refuses."""
    try:
        ctx = _command().make_context("ember serve", list(args))
    except Exception as exc:  # click's UsageError: typer's own copy of click from typer 0.26 on
        message = getattr(exc, "format_message", None)
        raise UsageError(message() if message else str(exc)) from None
    return ServeOptions(**ctx.params), list(ctx.args)


# The options a transformers pod's command sets (the operator's `ember serve --run-dir … --host …
# --port …`) or that would take the engine off the pod protocol: engine.args may not give them.
POD_OWNED = {
    "run_dir": "the pod's command sets it (the run directory shared with the sidecar)",
    "host": "the pod's command sets it (0.0.0.0, for the Service)",
    "port": f"the pod's command sets it (the Service targets port {contract.ENGINE_PORT})",
    "use_handoff": "a pod's engine always waits for the sidecar's hand-off",
    "archive": "the sidecar hands the archive over",
    "save_to": "the SAVE Job saves, the pods serve",
    "engine_kind": "engine.kind names the engine",
    "preload": "a pod's engine always runs under libember",
}


@functools.cache
def pod_owned_flags() -> Mapping[str, str]:
    """Every spelling of the POD_OWNED options (`--handoff` and `--no-handoff` …) and `--help`
    (it prints and exits), with why engine.args may not give it."""
    out = {"--help": "`ember serve` would print its help and exit"}
    for param in _command().params:
        for flag in [*param.opts, *param.secondary_opts] if param.name in POD_OWNED else []:
            out[flag] = POD_OWNED[param.name]
    return MappingProxyType(out)


def pod_options(model: str, args: Sequence[str]) -> ServeOptions:
    """The options of a transformers deployment's `ember serve`, its pods' and its SAVE Job's:
    `model` (its `model.name`) and `args` (its `engine.args`) as `ember.contract.serve_args` puts
    them. UsageError with what `ember serve` would refuse (an unknown option, a bad value) or what
    the pod's command owns (POD_OWNED)."""
    owned = pod_owned_flags()
    taken = dict.fromkeys(f for a in args if (f := a.split("=", 1)[0]) in owned)
    if taken:
        raise UsageError("; ".join(f"{f}: {owned[f]}" for f in taken))
    options, unknown = serve_options(contract.serve_args(model, args))
    if unknown:
        raise UsageError(f"{unknown} are not `ember serve` options")
    return options
