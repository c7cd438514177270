"""`ember serve`'s options; the server itself is `ember.serving.server`. The SAVE Job of a
transformers deployment reads its engine arguments as these options (`serve_options`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract
from ember.serving import server

# Arguments it does not know are kept: `--engine vllm` passes them on to `vllm serve`.
CONTEXT_SETTINGS: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True}


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
    layers: Annotated[int | None, typer.Option(help="Override the number of layers.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    host: Annotated[str, typer.Option(help="Listen address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port.")] = contract.ENGINE_PORT,
    run_dir: Annotated[Path | None, typer.Option(help="Sidecar run dir (EMBER_RUN_DIR).")] = None,
    use_handoff: Annotated[bool, typer.Option("--handoff/--no-handoff", help="Wait for the sidecar.")] = True,
    deadline: Annotated[float, typer.Option(help="Seconds to wait for the archive after the claim.")] = 30.0,
    archive: Annotated[
        Path | None, typer.Option(help="LOAD this archive dir (…/archives/<hash>) directly, no sidecar.")
    ] = None,
    num_blocks: Annotated[int, typer.Option(help="KV-cache blocks (native start).")] = 64,
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 256,
    max_batch_tokens: Annotated[int, typer.Option(help="Token budget per batch.")] = 1024,
    max_requests: Annotated[int, typer.Option(help="Requests per batch.")] = 64,
    q_interval: Annotated[int, typer.Option(help="Query padding interval (graph keys).")] = 256,
    kv_interval: Annotated[int, typer.Option(help="KV padding interval (graph keys).")] = 4096,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask.")] = 512,
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
    opts = {k: v for k, v in locals().items() if k != "ctx"}
    try:
        code = server.run(server.ServeOptions(**opts), ctx.args)
    except server.UsageError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code)


def serve_options(args: Sequence[str]) -> tuple[server.ServeOptions, list[str]]:
    """`args` parsed as `ember serve`'s command line: its options, and the arguments it does not
    know. UsageError with the command's message for a value it refuses."""
    app = typer.Typer(context_settings=CONTEXT_SETTINGS)
    app.command()(serve)
    try:
        ctx = typer.main.get_command(app).make_context("ember serve", list(args))
    except Exception as exc:  # click's UsageError: typer's own copy of click from typer 0.26 on
        message = getattr(exc, "format_message", None)
        raise server.UsageError(message() if message else str(exc)) from None
    return server.ServeOptions(**ctx.params), list(ctx.args)
