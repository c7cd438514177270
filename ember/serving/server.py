"""`ember serve`: an OpenAI-compatible server over transformers' continuous-batching engine (its
options are declared in ember.serving.options).

The process: re-exec under libember (SAVE or LOAD need it), arm it before the model is built,
serve HTTP at once (`ember.serving.http`, not ready yet), build the model, then start the engine
by the pod protocol (`ember.serving.startup`): restored graphs from the sidecar's archive, or
native capture on any refusal. Ready only after the first token. `--save-to` SAVEs instead, as
the SAVE Job of a transformers deployment does (`save`, under the operator's identity).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.serving.http import ByteTokenizer, ServerState, make_server
from ember.serving.options import ServeOptions, UsageError, serve_options
from ember.serving.startup import cb_starters, run_startup

if TYPE_CHECKING:
    from ember.identity import ArchiveIdentity
    from ember.runtime.save import SaveOutcome

log = logging.getLogger("ember.serving")


def run(o: ServeOptions, extra: Sequence[str] = ()) -> int:
    """Serve a model over HTTP (OpenAI-style) with transformers continuous batching: restored graphs
    from the sidecar's archive, or native capture on any refusal. Ready only after the first token.
    `--engine vllm` with `extra` (`vllm serve` args): supervise `vllm serve` behind the same hand-off."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s",
    )
    if o.engine_kind == "vllm":
        from ember.serving.vllm import supervise

        return supervise(list(extra), o.run_dir, use_handoff=o.use_handoff, deadline=o.deadline)
    if o.engine_kind != "transformers":
        raise UsageError(f"--engine {o.engine_kind!r}: transformers or vllm")
    if extra:
        raise UsageError(f"unexpected arguments {list(extra)} (only --engine vllm passes any on)")
    if o.model is None and o.model_config is None:
        raise UsageError("give --model NAME|DIR or --model-config FILE")
    if o.preload and (o.save_to or o.use_handoff or o.archive is not None):
        _reexec_under_libember("save" if o.save_to else "load")
    if o.save_to:
        result = save(o, o.save_to)
        print(json.dumps(result.summary(), default=str), flush=True)
        return 0 if result.published else 1
    state = ServerState(model_name=model_name(o), max_tokens_limit=o.max_tokens_limit)
    state.max_prompt_tokens = o.num_blocks * o.block_size // 2
    server = make_server(state, o.host, o.port)
    threading.Thread(target=server.serve_forever, name="ember-http", daemon=True).start()
    log.info("Listening on http://%s:%d (ready after the first token)", o.host, server.server_address[1])
    try:
        engine = _start_engine(state, o)
    except Exception as exc:
        state.error = f"{type(exc).__name__}: {exc}"
        log.exception("Engine start failed")
        return 1
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        engine.stop()
    return 0


def model_name(o: ServeOptions) -> str:
    return o.model or Path(str(o.model_config)).stem


def model_build(o: ServeOptions) -> dict[str, Any]:
    """`cb_engine.build_model`'s arguments: SAVE and LOAD build the same model from the same options."""
    return {"model": o.model, "model_config": o.model_config, "layers": o.layers, "seed": o.seed}


def engine_sizing(o: ServeOptions) -> dict[str, int]:
    """The continuous-batching engine's sizing (its own names) from the options."""
    return {
        "block_size": o.block_size,
        "num_blocks": o.num_blocks,
        "max_batch_tokens": o.max_batch_tokens,
        "max_requests_per_batch": o.max_requests,
        "q_padding_interval_size": o.q_interval,
        "kv_padding_interval_size": o.kv_interval,
    }


def save(o: ServeOptions, store_uri: str, identity: ArchiveIdentity | None = None) -> SaveOutcome:
    """SAVE every graph key of the engine `o` describes into `store_uri`, under `identity` (the
    SAVE Job's) or the engine's own (`cb_identity`). Run under libember in save mode."""
    from ember.engines.transformers_cb import adapter as cb_adapter
    from ember.engines.transformers_cb import engine as cb_engine

    ip = cb_adapter.session("save")  # armed before the model, as LOAD will be
    lm = cb_engine.build_model(**model_build(o))
    result, _ = cb_adapter.save_engine(lm, cb_engine.generation_config(), engine_sizing(o), store_uri,
                                       model_name(o), ip, identity=identity)
    return result


def _start_engine(state: ServerState, o: ServeOptions) -> Any:
    """Arm libember, build the model, start the engine restored or native; `state` ready after."""
    from ember.engines.transformers_cb import adapter as cb_adapter
    from ember.engines.transformers_cb import engine as cb_engine

    if o.use_handoff or o.archive is not None:
        cb_adapter.session("load")  # armed before the model: SAVE's allocation order
    if o.archive is not None:  # on the node already: its reconstruction overlaps the model build
        cb_adapter.open_early(o.archive)
    lm = cb_engine.build_model(**model_build(o))
    engine = cb_engine.CBEngine(lm)
    state.tokenizer = _tokenizer_for(o.model, engine.vocab_size)
    state.engine = engine
    starters = cb_starters(engine, engine_sizing(o), lambda args: claim_problem(o, args))
    state.startup = run_startup(
        starters, run_dir=o.run_dir, use_handoff=o.use_handoff, archive=o.archive, deadline=o.deadline
    )
    state.ready.set()
    return engine


def claim_problem(o: ServeOptions, claim_args: Sequence[str]) -> str:
    """Why this `ember serve` (options `o`) cannot serve a claim whose engine arguments are
    `claim_args` ("" when it can, or when the claim names none). The operator writes a transformers
    pod's model and sizing into its command (`ember.contract.serve_args`, set at the pod's
    creation) and claims it only with the same arguments (they are part of its pool's key): a claim
    whose arguments build another model or sizing means a pod claimed for another deployment,
    which must not serve its model."""
    if not claim_args:
        return ""
    try:
        theirs, unknown = serve_options(claim_args)
    except UsageError as exc:
        theirs, unknown = o, [str(exc)]
    if unknown or _engine_of(theirs) != _engine_of(o):
        return (f"the claim's engine arguments {list(claim_args)} are not the ones this engine was "
                f"started with (model {model_name(o)}): the pod belongs to another deployment's pool")
    return ""


def _engine_of(o: ServeOptions) -> tuple[dict[str, Any], dict[str, int]]:
    """What the options make of the engine: its model and its sizing."""
    return model_build(o), engine_sizing(o)


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
