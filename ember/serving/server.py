"""`ember serve`: an OpenAI-compatible server over transformers' continuous-batching engine.

Start-up follows the pod protocol (`ember.handoff`): wait for the sidecar's archive up to a
deadline → LOAD it inside the crash-safety marker (stages `compat`, `load`) → on any refusal,
report the fallback with its reason and capture natively (`capture`) → one token
(`first_token`) → only then `ready`. `/health` answers 503 until then, so no request ever meets
a half-started engine. Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (greedy decoding, no streaming), on loopback unless told otherwise.

The HTTP layer and the start-up sequence only see an `Engine` (generate token ids) and
`EngineStarters` (restore / native / first token), so both are tested on CPU with a fake
engine; `ember.engines.transformers_cb.engine.CBEngine` is the real one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated, Any, Protocol

import typer

from ember import handoff
from ember.runtime.adapter import Refused

log = logging.getLogger("ember.serving.server")


# ---------------------------------------------------------------------------------------------
# Engine and tokenizer seams
# ---------------------------------------------------------------------------------------------


class Engine(Protocol):
    vocab_size: int

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, timeout: float | None = ...
    ) -> list[int]: ...


class ByteTokenizer:
    """For random-weight models: UTF-8 bytes shifted past a few special ids; other ids print as <id>."""

    OFFSET = 3

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"vocab of {vocab_size} is too small for byte tokens")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode()] or [self.OFFSET]

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if self.OFFSET <= i < 256 + self.OFFSET:
                pending.append(i - self.OFFSET)
                continue
            out.append(pending.decode(errors="replace"))
            pending.clear()
            out.append(f"<{i}>")
        out.append(pending.decode(errors="replace"))
        return "".join(out)


# ---------------------------------------------------------------------------------------------
# Start-up sequence
# ---------------------------------------------------------------------------------------------


@dataclass
class StartupResult:
    mode: str = "starting"  # starting | restored | native | failed
    reason: str = ""  # why native; empty when restored
    stages: dict[str, float] = field(default_factory=dict)
    graphs: int = 0
    identity: str = ""


@dataclass
class EngineStarters:
    """`restore(archive_dir)` → (facts, seconds per stage, "compat"/"load" among them), raising
    Refused or anything else to refuse; `native()` → (facts, capture seconds);
    `first_token()` runs one token through the started engine."""

    restore: Callable[[Path], tuple[dict[str, Any], dict[str, float]]]
    native: Callable[[], tuple[dict[str, Any], float]]
    first_token: Callable[[], list[int]]


def run_startup(
    starters: EngineStarters,
    *,
    run_dir: str | Path | None = None,
    use_handoff: bool = True,
    archive: Path | None = None,
    deadline: float | None = 30.0,
    claim_timeout: float | None = None,
) -> StartupResult:
    """Wait → LOAD or capture → first token → ready. Never raises for a refused archive."""
    out = StartupResult()
    t0 = time.time()
    result: handoff.HandoffResult | None = None
    archive_dir: Path | None = archive
    if archive is None and use_handoff:
        handoff.report("standby", 0.0, "ok", run_dir=run_dir)
        result = handoff.wait_for_archive(run_dir, deadline, claim_timeout=claim_timeout)
        archive_dir, out.identity, out.reason = result.archive_dir, result.identity, result.reason
        status = handoff.read_json(result.run_dir / handoff.STATUS_FILE) or {}
        # A warm pod's clock starts at the claim, not at process start.
        t0 = max(t0, float(status.get("claimed_at") or 0.0))
    elif archive is None:
        out.reason = "handoff disabled"

    marker = None
    if archive_dir is not None and result is not None:
        # A process death from here to the first token leaves this marker: the next start in the
        # pod captures natively instead of loading again (ember.handoff.wait_for_archive).
        marker = result.run_dir / handoff.MARKER_FILE
        handoff.write_json_atomic(
            marker,
            {
                "identity": result.identity,
                "pid": os.getpid(),
                "started_at": time.time(),
                "archive_dir": str(archive_dir),
            },
        )
    if archive_dir is not None and _restore(starters, archive_dir, run_dir, out):
        out.mode = "restored"
        _first_token(starters, out, t0)  # an exception here keeps the marker: restored graphs failed
    if marker is not None:
        marker.unlink(missing_ok=True)
    if out.mode != "restored":
        _start_native(starters, out, run_dir)
        _first_token(starters, out, t0)
    handoff.report("first_token", out.stages["first_token"], "ok", run_dir=run_dir, mode=out.mode)
    handoff.report("ready", out.stages["first_token"], "ok", out.reason, run_dir=run_dir, mode=out.mode)
    log.info("Engine became ready: mode=%s reason=%r stages=%s", out.mode, out.reason, out.stages)
    return out


def _start_native(starters: EngineStarters, out: StartupResult, run_dir: str | Path | None) -> None:
    """Native capture (the engine's own start-up); reports `capture`."""
    t = time.monotonic()
    try:
        facts, seconds = starters.native()
    except Exception as exc:
        out.mode, out.reason = "failed", f"native start failed: {exc}"
        handoff.report("capture", time.monotonic() - t, "failed", out.reason, run_dir=run_dir)
        raise
    out.stages["capture"], out.graphs, out.mode = seconds, int(facts.get("graphs", 0)), "native"
    handoff.report("capture", seconds, "ok", out.reason, run_dir=run_dir)


def _first_token(starters: EngineStarters, out: StartupResult, t0: float) -> None:
    t = time.monotonic()
    starters.first_token()
    out.stages["first_token_run"] = time.monotonic() - t
    out.stages["first_token"] = time.time() - t0


def _restore(
    starters: EngineStarters, archive_dir: Path, run_dir: str | Path | None, out: StartupResult
) -> bool:
    t = time.monotonic()
    try:
        facts, seconds = starters.restore(archive_dir)
    except Exception as exc:
        stage = exc.stage if isinstance(exc, Refused) else "load"
        out.reason = str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}"
        handoff.report(stage, time.monotonic() - t, "fallback", out.reason, run_dir=run_dir)
        log.warning("Archive refused at %s, capturing natively: %s", stage, out.reason)
        return False
    for stage in ("compat", "load"):
        if stage in seconds:
            out.stages[stage] = seconds[stage]
            handoff.report(stage, seconds[stage], "ok", run_dir=run_dir)
    out.graphs = int(facts.get("graphs", 0))
    return True


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    model_name: str
    tokenizer: Any = None
    engine: Engine | None = None
    startup: StartupResult = field(default_factory=StartupResult)
    max_tokens_limit: int = 512
    max_prompt_tokens: int = 8192
    ready: threading.Event = field(default_factory=threading.Event)
    error: str = ""

    def health(self) -> tuple[int, dict[str, Any]]:
        body = {
            "status": "ready" if self.ready.is_set() else ("failed" if self.error else "starting"),
            "mode": self.startup.mode,
            "reason": self.startup.reason,
            "stages": self.startup.stages,
            "graphs": self.startup.graphs,
            "model": self.model_name,
        }
        if self.error:
            body["error"] = self.error
        return (200 if self.ready.is_set() else 503), body


class BadRequest(ValueError):
    pass


def _int_field(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}]")
    return value


def _check_sampling(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise BadRequest("'stream' is not supported by this server")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise BadRequest("only greedy decoding is served: 'temperature' must be 0 or absent")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' must be 1")


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """OpenAI prompt forms: a string, a list of token ids, or a list of either."""
    vocab = state.engine.vocab_size if state.engine is not None else 1 << 31
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise BadRequest("'prompt' must be a string, a list of token ids, or a non-empty list of those")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item)
        elif (
            isinstance(item, list)
            and item
            and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
        ):
            ids = item
        else:
            raise BadRequest("each prompt must be a non-empty string or list of token ids")
        if any(not 0 <= i < vocab for i in ids):
            raise BadRequest(f"token ids must be in [0, {vocab})")
        if len(ids) > state.max_prompt_tokens:
            raise BadRequest(f"prompt of {len(ids)} tokens exceeds {state.max_prompt_tokens}")
        out.append(ids)
    return out


def completions(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    _check_sampling(body)
    max_tokens = _int_field(body, "max_tokens", 16, 1, state.max_tokens_limit)
    prompts = _prompts(state, body.get("prompt"))
    assert state.engine is not None
    outputs = [state.engine.generate(p, max_tokens) for p in prompts]
    choices = [
        {
            "index": i,
            "text": state.tokenizer.decode(ids),
            "token_ids": ids,
            "logprobs": None,
            "finish_reason": "length" if len(ids) >= max_tokens else "stop",
        }
        for i, ids in enumerate(outputs)
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(prompts, outputs),
    }


def chat_completions(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    _check_sampling(body)
    max_tokens = _int_field(
        body,
        "max_tokens",
        _int_field(body, "max_completion_tokens", 16, 1, state.max_tokens_limit),
        1,
        state.max_tokens_limit,
    )
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
    ):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content")
    text = "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"
    prompts = _prompts(state, text)
    assert state.engine is not None
    ids = state.engine.generate(prompts[0], max_tokens)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": state.tokenizer.decode(ids)},
                "token_ids": ids,
                "finish_reason": "length" if len(ids) >= max_tokens else "stop",
            }
        ],
        "usage": _usage(prompts, [ids]),
    }


def _usage(prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, int]:
    p, c = sum(map(len, prompts)), sum(map(len, outputs))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def make_handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[ServerState, dict[str, Any]], dict[str, Any]]] = {
        "/v1/completions": completions,
        "/v1/chat/completions": chat_completions,
    }

    class Handler(BaseHTTPRequestHandler):
        server_version = "ember-serve"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s - %s", self.address_string(), fmt % args)

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            self._send(code, {"error": {"message": message, "type": kind, "code": code}})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/healthz", "/readyz"):
                self._send(*state.health())
            elif path == "/v1/models":
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "ember"}
                        ],
                    },
                )
            else:
                self._error(404, f"no route {path}", "not_found_error")

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            handler = routes.get(path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
            if handler is None:
                return self._error(404, f"no route {path}", "not_found_error")
            if not state.ready.is_set():
                return self._error(503, "engine is starting; retry when /health is ready", "unavailable")
            try:
                body = json.loads(raw or b"null")
                if not isinstance(body, dict):
                    raise BadRequest("request body must be a JSON object")
                self._send(200, handler(state, body))
            except (BadRequest, ValueError) as exc:
                self._error(400, str(exc))
            except Exception as exc:  # the engine failed this request; the server stays up
                log.exception("Request failed")
                self._error(500, f"{type(exc).__name__}: {exc}", "server_error")
            return None

    return Handler


def make_server(state: ServerState, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(state))
    server.daemon_threads = True
    return server


# ---------------------------------------------------------------------------------------------
# The real engine behind the seams
# ---------------------------------------------------------------------------------------------


def cb_starters(engine: Any, sizing_overrides: dict[str, Any]) -> EngineStarters:
    """EngineStarters over a CBEngine (imports torch/transformers lazily)."""
    from ember.engines.transformers_cb.adapter import restore_into

    def restore(archive_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
        info = restore_into(engine, archive_dir)
        return {"graphs": info.graphs}, info.seconds

    def native() -> tuple[dict[str, Any], float]:
        info = engine.start_native(**sizing_overrides)
        return {"graphs": info.graphs}, sum(info.seconds.values())

    def first_token() -> list[int]:
        return engine.generate(FIRST_TOKEN_PROMPT, max_new_tokens=1)

    return EngineStarters(restore, native, first_token)


FIRST_TOKEN_PROMPT = list(range(11, 27))


def serve(
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
    port: Annotated[int, typer.Option(help="Listen port.")] = 8000,
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
) -> None:
    """Serve a model over HTTP (OpenAI-style) with transformers continuous batching: restored graphs
    from the sidecar's archive, or native capture on any refusal. Ready only after the first token."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s",
    )
    if model is None and model_config is None:
        raise typer.BadParameter("give --model NAME|DIR or --model-config FILE")
    if preload and (save_to or use_handoff or archive is not None):
        _reexec_under_libember("save" if save_to else "load")
    from ember.engines.transformers_cb import adapter as cb_runtime
    from ember.engines.transformers_cb import engine as cb_engine

    name = model or Path(str(model_config)).stem
    sizing = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests,
        "q_padding_interval_size": q_interval,
        "kv_padding_interval_size": kv_interval,
    }
    if save_to:
        ip = cb_runtime.session("save")  # armed before the model, as LOAD will be
        lm = cb_engine.build_model(model, model_config, layers=layers, seed=seed)
        result, _ = cb_runtime.save_engine(lm, cb_engine.generation_config(), sizing, save_to, name, ip)
        typer.echo(json.dumps(result.summary(), default=str))
        raise typer.Exit(0 if result.published else 1)
    state = ServerState(model_name=name, max_tokens_limit=max_tokens_limit)
    server = make_server(state, host, port)
    threading.Thread(target=server.serve_forever, name="ember-http", daemon=True).start()
    log.info("Listening on http://%s:%d (ready after the first token)", host, server.server_address[1])
    try:
        if use_handoff or archive is not None:
            cb_runtime.session("load")  # armed before the model: SAVE's allocation order
        if archive is not None:  # on the node already: its reconstruction overlaps the model build
            cb_runtime.open_early(archive)
        lm = cb_engine.build_model(model, model_config, layers=layers, seed=seed)
        engine = cb_engine.CBEngine(lm)
        state.tokenizer = _tokenizer_for(model, engine.vocab_size)
        state.engine = engine
        state.max_prompt_tokens = num_blocks * block_size // 2
        state.startup = run_startup(
            cb_starters(engine, sizing),
            run_dir=run_dir,
            use_handoff=use_handoff,
            archive=archive,
            deadline=deadline,
        )
        state.ready.set()
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
