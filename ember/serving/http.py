"""The HTTP side of `ember serve`: an OpenAI-compatible API over an `Engine` (token ids in, token
ids out). Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (greedy decoding, no streaming). `/health` answers 503 until the
start-up (`ember.serving.startup`) reached its first token, so no request meets a half-started
engine. Tested on CPU with a fake engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from ember import contract
from ember.serving.startup import StartupResult

log = logging.getLogger("ember.serving")

# ---------------------------------------------------------------------------------------------
# Engine and tokenizer seams
# ---------------------------------------------------------------------------------------------


class Engine(Protocol):
    @property
    def vocab_size(self) -> int: ...

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


ROUTES: dict[str, Callable[[ServerState, dict[str, Any]], dict[str, Any]]] = {
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
}


class Handler(BaseHTTPRequestHandler):
    """One request; `state` is bound per server by `make_handler`."""

    state: ServerState

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
            self._send(*self.state.health())
        elif path == "/v1/models":
            self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": self.state.model_name, "object": "model", "created": 0, "owned_by": "ember"}
                    ],
                },
            )
        else:
            self._error(404, f"no route {path}", "not_found_error")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        handler = ROUTES.get(path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        if handler is None:
            return self._error(404, f"no route {path}", "not_found_error")
        if not self.state.ready.is_set():
            return self._error(503, "engine is starting; retry when /health is ready", "unavailable")
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            self._send(200, handler(self.state, body))
        except (BadRequest, ValueError) as exc:
            self._error(400, str(exc))
        except Exception as exc:  # the engine failed this request; the server stays up
            log.exception("Request failed")
            self._error(500, f"{type(exc).__name__}: {exc}", "server_error")
        return None


def make_handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    return type("BoundHandler", (Handler,), {"state": state})


def make_server(
    state: ServerState, host: str = "127.0.0.1", port: int = contract.ENGINE_PORT
) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(state))
    server.daemon_threads = True
    return server
