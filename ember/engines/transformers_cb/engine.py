"""A transformers continuous-batching engine ready to serve: model, manager, start-up, requests.

Used by `ember serve`, `ember bench cb` and the GPU tests. Start-up comes in two kinds, and both
go through `ember.engines.transformers_cb.hooks.ManagerHooks` so every capture is counted:

- `start_native()`: the engine's own behaviour (memory-based cache sizing unless given, warm-up
  capture of its largest graphs, then lazy capture on the request path);
- restored (`ember.engines.transformers_cb.adapter.restore_into`): the recorded sizing, restored
  graphs installed by the one LOAD pipeline, no capture.

Models have random weights from a transformers config (a built-in shape name or a config JSON
file) or come from a local checkpoint directory; nothing is downloaded. The same seed gives the
same weights in every process, so a SAVE process and a LOAD process produce the same tokens.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.engines.transformers_cb.hooks import ManagerHooks, cb_config_for, check_engine, new_manager
from ember.engines.transformers_cb.keys import CBSizing

# Built-in shapes (random weights). "tiny-llama" keeps tests and smoke runs fast.
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
}

# Serving defaults that keep the key set small enough to SAVE in one pass (see keys.py).
DEFAULT_SERVE_SIZING = {
    "block_size": 256,
    "num_blocks": 64,
    "max_batch_tokens": 1024,
    "max_requests_per_batch": 64,
    "q_padding_interval_size": 256,
    "kv_padding_interval_size": 4096,
}


def model_config_dict(
    model: str | None = None, model_config: str | Path | None = None, layers: int | None = None
) -> dict[str, Any]:
    """The transformers config (as a dict with model_type) for a built-in name or a JSON file."""
    if model_config is not None:
        data = json.loads(Path(model_config).read_text())
        if "model_type" not in data:
            raise ValueError(f"{model_config}: a transformers config needs 'model_type'")
    elif model in BUILTIN_SHAPES:
        data = dict(BUILTIN_SHAPES[model])
    else:
        raise ValueError(
            f"unknown model {model!r}: use one of {', '.join(BUILTIN_SHAPES)}, "
            "--model-config FILE or a local checkpoint directory"
        )
    if layers is not None:
        data["num_hidden_layers"] = layers
    return data


def build_model(
    model: str | None = None,
    model_config: str | Path | None = None,
    *,
    layers: int | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    attn: str = "sdpa",
) -> Any:
    """A causal LM on the GPU, eval mode: random weights (seeded) or a local checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if model is not None and Path(model).is_dir():
        lm = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch_dtype, attn_implementation=attn, device_map="cuda"
        )
        return lm.eval()
    data = model_config_dict(model, model_config, layers)
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("cuda"):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
    finally:
        torch.set_default_dtype(previous)
    return lm.eval()


def generation_config(max_new_tokens: int = 16) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


@dataclass
class StartInfo:
    """How the engine started: mode, seconds per step, graphs, and why it is native if it is."""

    mode: str  # "restored" | "native"
    seconds: dict[str, float] = field(default_factory=dict)
    graphs: int = 0
    reason: str = ""
    sizing: dict[str, Any] = field(default_factory=dict)


class CBEngine:
    """A started ContinuousBatchingManager plus a result dispatcher for concurrent requests."""

    def __init__(self, model: Any, max_new_tokens: int = 16) -> None:
        self.model = model
        self.gen_config = generation_config(max_new_tokens)
        self.manager: Any = None
        self.hooks: ManagerHooks | None = None
        self.library: Any = None  # the restored graphs' GraphLibrary (kept alive while serving)
        self.info: StartInfo | None = None
        self._futures: dict[str, Future[list[int]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dispatcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._serving_mark = 0

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    # -- start-up ------------------------------------------------------------------------------

    def start_native(
        self, sizing: CBSizing | None = None, warmup: bool = True, **cb_overrides: Any
    ) -> StartInfo:
        """The engine's own start-up: its warm-up captures, then lazy capture while serving."""
        t0 = time.perf_counter()
        self.manager = new_manager(self.model, self.gen_config, cb_config_for(sizing, **cb_overrides))
        self.hooks = ManagerHooks(self.manager) if not check_engine() else None
        t1 = time.perf_counter()
        if warmup:
            self.manager.warmup()
        t2 = time.perf_counter()
        info = StartInfo(
            "native",
            {"manager": t1 - t0, "warmup_capture": t2 - t1},
            graphs=self.hooks.captures.count if self.hooks else 0,
            sizing=self.hooks.sizing.to_json() if self.hooks else {},
        )
        self.start(info)
        return info

    def start(self, info: StartInfo) -> None:
        """Start serving (the manager is built: natively, or restored by `adapter.restore_into`)."""
        self.info = info
        self._serving_mark = self.hooks.serving_mark() if self.hooks else 0
        self.manager.start()
        self._dispatcher = threading.Thread(target=self._dispatch, name="ember-cb-results", daemon=True)
        self._dispatcher.start()

    # -- requests ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], max_new_tokens: int) -> Future[list[int]]:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if self.manager is None:
            raise RuntimeError("engine not started")
        request_id = f"ember-{next(self._ids)}"
        future: Future[list[int]] = Future()
        with self._lock:
            self._futures[request_id] = future
        added = self.manager.add_request(
            list(prompt_ids), request_id=request_id, max_new_tokens=max_new_tokens
        )
        if added is None:
            with self._lock:
                self._futures.pop(request_id, None)
            raise RuntimeError("engine refused the request (stopping or failed)")
        return future

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, timeout: float | None = 120.0
    ) -> list[int]:
        return self.submit(prompt_ids, max_new_tokens).result(timeout=timeout)

    def generate_many(
        self, prompts: list[list[int]], max_new_tokens: int, timeout: float | None = 300.0
    ) -> list[list[int]]:
        """All `prompts` reach the engine's queue at once, so its next step schedules them
        together: one by one, how many the running generation loop took into a batch depended on
        thread timing, and so did the padded keys and with them the tokens (a batch's size
        changes a GEMM's kernel and its rounding)."""
        futures = self.submit_together(prompts, max_new_tokens)
        return [f.result(timeout=timeout) for f in futures]

    def submit_together(self, prompts: list[list[int]], max_new_tokens: int) -> list[Future[list[int]]]:
        real = self.manager.input_queue
        staged: list[Any] = []

        class Staging:  # `add_request` validates and builds each request state, then puts it here
            def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
                staged.append(item)

        self.manager.input_queue = Staging()
        try:
            futures = [self.submit(p, max_new_tokens) for p in prompts]
        finally:
            self.manager.input_queue = real
        with real.not_empty:  # one put of them all (the generation loop drains under this lock)
            real.queue.extend(staged)
            real.unfinished_tasks += len(staged)
            real.not_empty.notify()
        return futures

    def _dispatch(self) -> None:
        while not self._stopping.is_set():
            result = self.manager.get_result(timeout=0.05)
            if result is None:
                if not self.manager.is_running():
                    self._fail_all(RuntimeError("engine generation loop stopped"))
                    if self._stopping.wait(0.05):
                        return
                continue
            if not result.is_finished():
                continue
            with self._lock:
                future = self._futures.pop(result.request_id, None)
            if future is None:
                continue
            if result.error is not None:
                future.set_exception(RuntimeError(str(result.error)))
            else:
                future.set_result(list(result.generated_tokens))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            futures, self._futures = self._futures, {}
        for f in futures.values():
            if not f.done():
                f.set_exception(error)

    # -- facts and shutdown --------------------------------------------------------------------

    @property
    def captures_while_serving(self) -> int:
        return len(self.hooks.captures_since(self._serving_mark)) if self.hooks else -1

    def serving_capture_keys(self) -> list[tuple[int, ...]]:
        return [k for k, _ in self.hooks.captures_since(self._serving_mark)] if self.hooks else []

    def stop(self) -> None:
        self._stopping.set()
        if self.manager is not None:
            self.manager.stop(block=True, timeout=10)
            self.manager.destroy()
        self._fail_all(RuntimeError("engine stopped"))
