"""Adapter for transformers' continuous-batching engine: SAVE every graph key once, LOAD them all.

The engine (transformers 5.17, `generation/continuous_batching/`) captures a CUDA graph per key
lazily on the request path (`model_runner.py` `ModelRunner._capture_graph`, called from
`compute_batch` when `inputs_and_outputs.get_graph()` misses) and keeps them in a per-IO
`CudaGraphBuffer` (`utils.py`: key → object with `replay()`/`reset()`). This adapter touches only
those two places, on one manager instance, never the classes:

- SAVE (`ManagerHooks.capture_all`): enumerate every key the scheduler can produce for the resolved
  sizing (`ember.engines.transformers_cb.keys`), drive the engine's own `compute_batch` once per key with a
  synthetic batch (the engine's warm-up states, padded to the key), so the engine captures with
  its own code into its own shared pool; graphs are kept (`keep_graph=True`) for the runtime's
  SAVE. The resolved cache sizing (num_blocks, max_batch_tokens, ...) goes into the archive so
  LOAD builds the same cache without sizing it from free memory.
- LOAD (`ManagerHooks.install`): in a fresh process, configure the manager with the recorded sizing
  (`cb_config_for`), create its batch processor (cache and static IO tensors, allocated in the
  same order as at SAVE), and put the runtime's restored graphs into the graph buffers.
- Serving: every capture the engine makes goes through an observer on the runner instance
  (`CaptureLog`): the goal after LOAD is zero.

`check_engine()` verifies the version and every internal used here; on any difference the
callers (`ember serve`, `ember bench cb`) run the engine natively instead.

What this module deliberately does not do: walk, serialize, rebuild or verify graphs (the graph
runtime: `ember.runtime.save` / `ember.runtime.load`), or decide between LOAD and native capture
(`ember.serving.startup` does, from the sidecar handoff).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ember.engines.transformers_cb.keys import (
    FULL,
    SLIDING,
    CBSizing,
    GraphKey,
    enumerate_keys,
    pad_to_interval,
    pad_to_pow2,
)

ENGINE = "transformers-cb"
SUPPORTED_VERSIONS = ("5.17.",)
DEFAULT_MAX_GRAPHS = 512

ArchiveKey = tuple[int, ...]  # (io_pair, *engine key): what the archive's graph table is keyed by


class EngineMismatch(RuntimeError):
    """The installed engine is not the one this adapter knows: run it natively."""


class TooManyGraphs(ValueError):
    """The sizing gives more keys than SAVE may capture; coarser padding intervals fix it."""


class CaptureError(RuntimeError):
    """A synthetic batch did not produce the key it was built for (SAVE refuses the archive)."""


def archive_key(io_pair: int, key: GraphKey) -> ArchiveKey:
    return (io_pair, *key)


def split_archive_key(akey: ArchiveKey) -> tuple[int, GraphKey]:
    if len(akey) < 2 or akey[0] not in (0, 1):
        raise ValueError(f"not a continuous-batching archive key: {akey!r}")
    return akey[0], tuple(akey[1:])


# ---------------------------------------------------------------------------------------------
# Engine check (version and every internal the adapter touches)
# ---------------------------------------------------------------------------------------------


def engine_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_engine() -> list[str]:
    """Problems that make the adapter unusable here (empty: the adapter may patch this engine)."""
    version = engine_version()
    if version is None:
        return ["transformers is not installed"]
    if not version.startswith(SUPPORTED_VERSIONS):
        return [f"transformers {version} is not supported (adapter knows {', '.join(SUPPORTED_VERSIONS)}x)"]
    problems: list[str] = []
    try:
        from transformers.generation.continuous_batching import (
            continuous_api,
            input_outputs,
            model_runner,
            utils,
        )
    except ImportError as exc:
        return [f"transformers continuous batching does not import: {exc}"]
    needed = {
        model_runner.ModelRunner: ("_capture_graph", "compute_batch", "maybe_pad_inputs"),
        input_outputs.ContinuousBatchingIOs: ("_get_graph_key", "prepare_batch_tensors", "get_model_kwargs"),
        input_outputs.ContinuousBatchingAsyncIOs: ("swap_io_pairs", "get_graph"),
        utils.CudaGraphBuffer: ("get_graph", "set_graph"),
        continuous_api.ContinuousBatchingManager: ("_create_batch_processor", "warmup", "start"),
    }
    for cls, names in needed.items():
        problems += [f"{cls.__name__}.{n} is missing" for n in names if not hasattr(cls, n)]
    if not hasattr(utils, "create_warmup_future_states"):
        problems.append("utils.create_warmup_future_states is missing")
    # The key arithmetic must be the engine's: spot-check the padding helpers against the mirror.
    for args in [(1, 64, 8192), (65, 64, 8192), (0, 16384, 510720), (9000, 64, 8192)]:
        if utils.pad_to_interval(*args) != pad_to_interval(*args):
            problems.append(f"pad_to_interval{args} differs from ember.engines.transformers_cb.keys")
    for args in [(1, 512, 1024), (3000, 510720, 1024), (5, 64, 0), (100, 64, 0)]:
        if utils.pad_to_pow2(*args) != pad_to_pow2(*args):
            problems.append(f"pad_to_pow2{args} differs from ember.engines.transformers_cb.keys")
    return problems


def require_engine() -> None:
    if problems := check_engine():
        raise EngineMismatch("; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Building a manager with a known sizing
# ---------------------------------------------------------------------------------------------


def cb_config_for(sizing: CBSizing | None = None, **overrides: Any) -> Any:
    """A ContinuousBatchingConfig: the recorded sizing (LOAD: no memory-based sizing) or overrides."""
    from transformers import ContinuousBatchingConfig

    kwargs: dict[str, Any] = {"use_cuda_graph": True}
    if sizing is not None:
        kwargs.update(
            block_size=sizing.block_size,
            num_blocks=sizing.num_blocks,
            max_batch_tokens=sizing.max_batch_tokens,
            max_requests_per_batch=sizing.max_requests_per_batch,
            max_blocks_per_request=sizing.max_blocks_per_request,
            q_padding_interval_size=sizing.q_padding_interval_size,
            kv_padding_interval_size=sizing.kv_padding_interval_size,
            use_cuda_graph=(sizing.use_cuda_graph_varlen, sizing.use_cuda_graph_decode),
            use_async_batching=sizing.io_pairs == 2,
        )
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return ContinuousBatchingConfig(**kwargs)


def new_manager(model: Any, generation_config: Any, cb_config: Any) -> Any:
    """A fresh (not cached, not started) ContinuousBatchingManager for `model`."""
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        model.destroy_cached_continuous_batching_manager()
    return model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=cb_config
    )


# ---------------------------------------------------------------------------------------------
# Observing captures
# ---------------------------------------------------------------------------------------------


@dataclass
class CaptureLog:
    """Every graph the engine captured through the observed runner: key and seconds."""

    events: list[tuple[ArchiveKey, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, key: ArchiveKey, seconds: float) -> None:
        with self._lock:
            self.events.append((key, seconds))

    @property
    def count(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> list[tuple[ArchiveKey, float]]:
        with self._lock:
            return list(self.events[mark:])

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.events)


class _KeepGraph:
    """Within the context, `torch.cuda.CUDAGraph()` built by the engine keeps its cudaGraph_t."""

    _lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[list[Any]]:
        import torch

        made: list[Any] = []
        base = torch.cuda.CUDAGraph

        class KeptGraph(base):  # type: ignore[misc, valid-type]
            def __new__(cls, keep_graph: bool = False) -> Any:
                graph = base.__new__(cls, keep_graph=True)
                made.append(graph)
                return graph

            def __init__(self, keep_graph: bool = False) -> None:
                super().__init__(keep_graph=True)

        with self._lock:
            torch.cuda.CUDAGraph = KeptGraph
            try:
                yield made
            finally:
                torch.cuda.CUDAGraph = base


keep_graph = _KeepGraph()


# ---------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------


class ManagerHooks:
    """One ContinuousBatchingManager, its batch processor created, its captures observed.

    Create it after the manager (and before `manager.start()`): it creates the batch processor
    now (KV cache and static IO tensors: the allocations LOAD must repeat in SAVE's order).
    """

    def __init__(self, manager: Any) -> None:
        require_engine()
        self.manager = manager
        if manager.batch_processor is None:
            manager.batch_processor = manager._create_batch_processor()
        self.processor = manager.batch_processor
        self.runner = self.processor.model_runner
        self.io = self.processor.inputs_and_outputs
        self.captures = CaptureLog()
        self.keep_graphs = False
        self._kept: dict[ArchiveKey, Any] = {}
        self._observe()

    # -- facts ---------------------------------------------------------------------------------

    @property
    def is_async(self) -> bool:
        return hasattr(self.io, "io_pairs")

    def device_ios(self) -> list[Any]:
        """The device-side IO object of each IO pair (each owns a graph buffer)."""
        return [p.device_io for p in self.io.io_pairs] if self.is_async else [self.io]

    @property
    def sizing(self) -> CBSizing:
        cache, cfg = self.processor.cache, self.processor.cb_config
        layer_types = ((FULL,) if cache.num_full_attention_groups else ()) + (
            (SLIDING,) if cache.num_sliding_attention_groups else ()
        )
        varlen, decode = cfg.cuda_graph_booleans
        return CBSizing(
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            max_batch_tokens=cache.max_batch_tokens,
            max_requests_per_batch=cfg.max_requests_per_batch,
            q_padding_interval_size=cfg.q_padding_interval_size,
            kv_padding_interval_size=cfg.kv_padding_interval_size,
            layer_types=layer_types,
            sliding_window=int(getattr(self.processor.config, "sliding_window", None) or 0),
            max_blocks_per_request=cache.max_blocks_per_request,
            use_cuda_graph_varlen=bool(varlen),
            use_cuda_graph_decode=bool(decode),
            io_pairs=2 if self.is_async else 1,
        )

    def expected_keys(self) -> list[ArchiveKey]:
        """Every archive key of this sizing, largest varlen first (the engine's own warm-up order)."""
        sizing = self.sizing
        keys = enumerate_keys(sizing)
        varlen = sorted((k for k in keys if len(k) > 1), reverse=True)
        decode = sorted((k for k in keys if len(k) == 1), reverse=True)
        return [archive_key(pair, k) for pair in range(sizing.io_pairs) for k in varlen + decode]

    def installed_keys(self) -> list[ArchiveKey]:
        return [archive_key(pair, k) for pair, io in enumerate(self.device_ios()) for k in io.graphs._storage]

    def engine_facts(self) -> dict[str, Any]:
        """What the archive records for LOAD (manifest `engine`)."""
        sizing, cache = self.sizing, self.processor.cache
        return {
            "kind": ENGINE,
            "version": engine_version(),
            "sizing": sizing.to_json(),
            "num_blocks": sizing.num_blocks,
            "max_batch_tokens": sizing.max_batch_tokens,
            "kv_cache_bytes": sum(t.nbytes for t in [*cache.key_cache, *cache.value_cache]),
            "attn_implementation": self.processor.config._attn_implementation,
        }

    # -- observing -----------------------------------------------------------------------------

    def _current_key(self) -> ArchiveKey:
        if self.is_async:
            pair = self.io.current_pair
            return archive_key(pair, self.io.io_pairs[pair].device_io._get_graph_key())
        return archive_key(0, self.io._get_graph_key())

    def _observe(self) -> None:
        original: Callable[..., None] = self.runner._capture_graph

        def observed_capture(forward_fn: Callable[..., Any], compute_stream: Any, *args: Any) -> None:
            key = self._current_key()
            start = time.perf_counter()
            if self.keep_graphs:
                with keep_graph() as made:
                    original(forward_fn, compute_stream, *args)
                if made:
                    made[-1].instantiate()
                    self._kept[key] = made[-1]
            else:
                original(forward_fn, compute_stream, *args)
            self.captures.record(key, time.perf_counter() - start)

        self.runner._capture_graph = observed_capture  # instance attribute: this runner only

    # -- SAVE ----------------------------------------------------------------------------------

    def capture_all(
        self,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        progress: Callable[[int, int, ArchiveKey], None] | None = None,
    ) -> dict[ArchiveKey, Any]:
        """Capture every key once through the engine's own path; return the kept CUDAGraphs."""
        import torch

        keys = self.expected_keys()
        if len(keys) > max_graphs:
            s = self.sizing
            raise TooManyGraphs(
                f"{len(keys)} graph keys for max_batch_tokens={s.max_batch_tokens}, num_pages={s.num_pages}, "
                f"q_padding_interval_size={s.q_padding_interval_size}, "
                f"kv_padding_interval_size={s.kv_padding_interval_size} (limit {max_graphs}): "
                "use larger padding intervals or a smaller cache/token budget"
            )
        self.keep_graphs = True
        try:
            with torch.no_grad():
                for i, akey in enumerate(keys):
                    if progress is not None:
                        progress(i, len(keys), akey)
                    if akey in self._kept:
                        continue
                    self._run_key(akey)
                    if akey not in self._kept:
                        got = self.captures.events[-1][0] if self.captures.events else None
                        raise CaptureError(f"synthetic batch for {akey} captured {got} instead")
        finally:
            self.keep_graphs = False
        return {k: self._kept[k] for k in keys}

    def _run_key(self, akey: ArchiveKey) -> None:
        """One synthetic batch padded to `akey`, through prepare → get_model_kwargs → compute_batch."""
        self._with_batch(akey, lambda batch: self.runner.compute_batch(self.manager.model, batch))

    def canary(self, akey: ArchiveKey, launch: Callable[[Any], None], seed: int = 5,
               times: dict[str, float] | None = None) -> list[int]:
        """LOAD's canary state for `akey` and what `launch(stream)` (the key's graph) computes from it:
        the synthetic batch SAVE captured the key with, its input ids seeded, the cache rows its
        one request reads and writes zeroed, the output poisoned; returns the fingerprint of the
        sampled tokens and of the K and V rows the request wrote, every layer, in batch order
        (`ember.engines.transformers_cb.canary`). One sampled token shows little (a graph
        computing otherwise often samples the same argmax); those rows hold what every layer
        computed from the canary's tokens. Only the request's rows: the cost does not grow with
        the cache, and neither the trash row (padding tokens write it in no set order) nor the
        physical blocks the request got (SAVE's and LOAD's may differ) enter it. SAVE records it
        with the native graph; LOAD compares the restored one (`ember.runtime.verify`). `times`
        gets where the path's milliseconds went: `batch` (prepared and freed through transformers'
        CB code), `rows` (found and zeroed, ids seeded), `graph` (the launch until the GPU is done,
        a build inside `launch` included), `fingerprint`."""
        import torch

        from ember.engines.transformers_cb.canary import batch_rows, digest, written_digests, zero_rows

        pair, _ = split_archive_key(akey)
        io = self.device_ios()[pair]
        cache = self.processor.cache
        vocab = int(self.manager.model.config.get_text_config().vocab_size)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        rows: list[Any] = []

        marks = [time.perf_counter()]  # entered, batch ready, launch, GPU done, batch freed

        def run(batch: Any) -> None:
            marks.append(time.perf_counter())
            rows.extend(batch_rows(self._host_io(pair), cache))  # before the launch
            torch.cuda.synchronize()  # the batch's host-to-device copies are in
            zero_rows(cache, rows)
            io.output_ids.view(torch.uint8).fill_(0xA5)
            ids = batch["input_ids"]
            ids.copy_(torch.randint(1, vocab, tuple(ids.shape), generator=gen, dtype=ids.dtype))
            stream = self.io.compute_stream or torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            marks.append(time.perf_counter())
            with torch.cuda.stream(stream):
                launch(stream)
            torch.cuda.synchronize()  # the graph's time apart (the fingerprint would wait for it anyway)
            marks.append(time.perf_counter())

        self._with_batch(akey, run)
        marks.append(time.perf_counter())
        out = [digest([io.output_ids]), *written_digests(cache, rows)]
        if times is not None:
            entered, ready, launched, done, freed = marks
            times.update(batch=(ready - entered + freed - done) * 1e3, rows=(launched - ready) * 1e3,
                         graph=(done - launched) * 1e3, fingerprint=(time.perf_counter() - freed) * 1e3)
        return out

    def _host_io(self, pair: int) -> Any:
        """The IO a batch is prepared into: the pair's host IO (async batching) or the IO itself."""
        return self.io.io_pairs[pair].host_io if self.is_async else self.io

    def _with_batch(self, akey: ArchiveKey, run: Callable[[Any], None]) -> None:
        """`run(model kwargs)` on one synthetic batch padded to `akey` (prepare → get_model_kwargs);
        its cache blocks are freed after."""
        import torch
        from transformers.generation.continuous_batching.requests import RequestStatus
        from transformers.generation.continuous_batching.utils import create_warmup_future_states

        pair, key = split_archive_key(akey)
        decode = len(key) == 1
        cache = self.processor.cache
        if self.is_async:
            self.io.current_pair = pair
        host = self._host_io(pair)
        status = RequestStatus.DECODING if decode else RequestStatus.PREFILLING
        states = create_warmup_future_states(1, status, 1, cache.block_size if decode else 0, cache)
        if not states:
            raise CaptureError(f"no cache block free for the synthetic batch of {akey}")
        try:
            q, kv = (key[0], 0) if decode else (key[0], key[1])
            processors = self.processor.logit_processor
            self.io.prepare_batch_tensors(states, processors, decode, q, kv, use_padding=True)
            if not decode:
                # The key's lengths are the padded longest key length per layer type; the synthetic
                # request is short, so set them (get_model_kwargs pads a power of two to itself).
                for layer_type, length in zip(list(host.max_seqlen_k), key[2:], strict=True):
                    host.max_seqlen_k[layer_type] = length
            batch = self.io.get_model_kwargs(use_padding=True)
            run(batch)
            torch.cuda.synchronize()
        finally:
            for fs in states:
                cache.free_blocks(fs.state.request_id)

    # -- LOAD ----------------------------------------------------------------------------------

    def install(self, graphs: Mapping[ArchiveKey, Any]) -> int:
        """Put restored graphs (objects with replay()/reset()) into the engine's graph buffers.

        Every expected key must be present (a partial set would capture while serving): raises
        KeyError naming the first missing keys, before installing anything.
        """
        expected = self.expected_keys()
        missing = [k for k in expected if k not in graphs]
        if missing:
            raise KeyError(f"archive lacks {len(missing)} of {len(expected)} graph keys, e.g. {missing[:3]}")
        ios = self.device_ios()
        for akey in expected:
            graph = graphs[akey]
            if not (callable(getattr(graph, "replay", None)) and callable(getattr(graph, "reset", None))):
                raise TypeError(f"restored graph for {akey} lacks replay()/reset()")
            pair, key = split_archive_key(akey)
            ios[pair].graphs.set_graph(key, graph)
        self.manager.warmed_up = True
        return len(expected)

    def serving_mark(self) -> int:
        """Mark the start of serving; `captures_since(mark)` then counts captures on the request path."""
        return self.captures.count

    def captures_since(self, mark: int) -> list[tuple[ArchiveKey, float]]:
        return self.captures.since(mark)
