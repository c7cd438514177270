"""`ember serve`: an OpenAI-compatible server over transformers' continuous-batching engine.

The process: re-exec under libember (SAVE or LOAD need it), arm it before the model is built,
serve HTTP at once (`ember.serving.http`, not ready yet), build the model, then start the engine
by the pod protocol (`ember.serving.startup`): restored graphs from the sidecar's archive, or
native capture on any refusal. Ready only after the first token. `--save-to` SAVEs instead.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract
from ember.serving.http import ByteTokenizer, ServerState, make_server
from ember.serving.startup import cb_starters, run_startup

log = logging.getLogger("ember.serving")


# long: typer declares every option in the signature; the body is a few steps
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
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s",
    )
    if engine_kind == "vllm":
        from ember.serving.vllm import supervise

        raise typer.Exit(supervise(list(ctx.args), run_dir, use_handoff=use_handoff, deadline=deadline))
    if engine_kind != "transformers":
        raise typer.BadParameter(f"--engine {engine_kind!r}: transformers or vllm")
    if ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args} (only --engine vllm passes any on)")
    if model is None and model_config is None:
        raise typer.BadParameter("give --model NAME|DIR or --model-config FILE")
    if preload and (save_to or use_handoff or archive is not None):
        _reexec_under_libember("save" if save_to else "load")
    name = model or Path(str(model_config)).stem
    sizing = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests,
        "q_padding_interval_size": q_interval,
        "kv_padding_interval_size": kv_interval,
    }
    build = {"model": model, "model_config": model_config, "layers": layers, "seed": seed}
    if save_to:
        _save_and_exit(build, sizing, save_to, name)
    state = ServerState(model_name=name, max_tokens_limit=max_tokens_limit)
    state.max_prompt_tokens = num_blocks * block_size // 2
    server = make_server(state, host, port)
    threading.Thread(target=server.serve_forever, name="ember-http", daemon=True).start()
    log.info("Listening on http://%s:%d (ready after the first token)", host, server.server_address[1])
    try:
        engine = _start_engine(state, build, sizing, run_dir, use_handoff, archive, deadline)
    except Exception as exc:
        state.error = f"{type(exc).__name__}: {exc}"
        log.exception("Engine start failed")
        raise typer.Exit(1) from exc
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        engine.stop()


def _save_and_exit(build: dict[str, Any], sizing: dict[str, Any], save_to: str, name: str) -> None:
    """`--save-to`: SAVE every graph key of this engine, print the summary, exit."""
    from ember.engines.transformers_cb import adapter as cb_adapter
    from ember.engines.transformers_cb import engine as cb_engine

    ip = cb_adapter.session("save")  # armed before the model, as LOAD will be
    lm = cb_engine.build_model(**build)
    result, _ = cb_adapter.save_engine(lm, cb_engine.generation_config(), sizing, save_to, name, ip)
    typer.echo(json.dumps(result.summary(), default=str))
    raise typer.Exit(0 if result.published else 1)


def _start_engine(
    state: ServerState,
    build: dict[str, Any],
    sizing: dict[str, Any],
    run_dir: Path | None,
    use_handoff: bool,
    archive: Path | None,
    deadline: float,
) -> Any:
    """Arm libember, build the model, start the engine restored or native; `state` ready after."""
    from ember.engines.transformers_cb import adapter as cb_adapter
    from ember.engines.transformers_cb import engine as cb_engine

    if use_handoff or archive is not None:
        cb_adapter.session("load")  # armed before the model: SAVE's allocation order
    if archive is not None:  # on the node already: its reconstruction overlaps the model build
        cb_adapter.open_early(archive)
    lm = cb_engine.build_model(**build)
    engine = cb_engine.CBEngine(lm)
    state.tokenizer = _tokenizer_for(build["model"], engine.vocab_size)
    state.engine = engine
    starters = cb_starters(engine, sizing)
    state.startup = run_startup(
        starters, run_dir=run_dir, use_handoff=use_handoff, archive=archive, deadline=deadline
    )
    state.ready.set()
    return engine


def _reexec_under_libember(mode: str) -> None:
    """Replace this process with itself under LD_PRELOAD=libember.so EMBER_MODE=mode, if built."""
    from ember import native

    if native.find_library() is None:
        log.warning("libember.so not found: serving without it (archives will be refused, native capture)")
        return
    from ember.runtime.session import reexec_under_libember

    reexec_under_libember(mode)


def _tokenizer_for(model: str | None, vocab_size: int) -> Any:
    if model is not None and Path(model).is_dir():
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError):
            pass
    return ByteTokenizer(vocab_size)
