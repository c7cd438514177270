"""transformers' continuous-batching engine as an engine adapter, and its SAVE/LOAD entry points.

`CBEngineAdapter` puts one `CBEngine` (`engine.py`) behind `ember.runtime.adapter.EngineAdapter`;
the one pipeline (`ember.runtime.save` / `ember.runtime.load`) does the rest. Callers
(`ember serve`, the SAVE Job of engine transformers, `ember bench cb`, the GPU tests) use the
functions below:

SAVE (process under LD_PRELOAD=libember.so EMBER_MODE=save EMBER_ARM=manual)::

    ip = session("save")                        # arm BEFORE the model is built
    model = build_model(...)
    result = save_engine(model, gen_config, sizing_overrides, store_uri, model_name, ip,
                         identity=None)         # the SAVE Job's: the operator's name for it

LOAD (fresh process, EMBER_MODE=load)::

    session("load")                             # arm BEFORE the model is built
    open_early(archive_dir)                     # optional: the archive is on the node already
    model = build_model(...)                    # same allocations, same order as SAVE
    engine = CBEngine(model)
    info = restore_into(engine, archive_dir)    # Refused → capture natively

LOAD checks, in order, before anything launches: the compatibility key, the engine facts (kind,
sizing), blob digests, the static buffers' addresses against SAVE's, the capture window's
allocation replay; then the templates are taken over and every key is installed in the engine's
graph buffers.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.engines.transformers_cb.canary import IDENTITY_WORKLOAD
from ember.engines.transformers_cb.canary import KIND as CANARY_KIND
from ember.engines.transformers_cb.engine import CBEngine, StartInfo
from ember.engines.transformers_cb.hooks import (
    DEFAULT_MAX_GRAPHS,
    ENGINE,
    ManagerHooks,
    cb_config_for,
    check_engine,
    engine_version,
    new_manager,
)
from ember.engines.transformers_cb.keys import CBSizing, enumerate_keys
from ember.identity import ArchiveIdentity, config_digest
from ember.runtime.adapter import COMPAT, LOAD, GraphKey, Refused

if TYPE_CHECKING:
    from ember.runtime.graphs.templates import GraphLibrary
    from ember.runtime.publish import ArchiveContent
    from ember.runtime.restore import ArchiveRestore
    from ember.runtime.save import SaveOutcome

log = logging.getLogger(__name__)
_SESSION: Any = None


def compat_engine() -> str:
    return f"{ENGINE} {engine_version()}"


def session(mode: str) -> Any:
    """libember's Interposer armed in `mode` (None when not preloaded). Call before building the model."""
    global _SESSION
    from ember.runtime.session import native_session

    _SESSION = native_session(mode)
    if mode == "load":
        import_load_path()
    return _SESSION


def import_load_path() -> None:
    """Import what LOAD runs now, at process start, not when the engine starts: first imports of
    the archive and restore modules took ~40 ms of the engine's start on H100's host."""
    for name in ("restore", "publish", "graphs.templates", "compat", "load"):
        importlib.import_module(f"ember.runtime.{name}")


def cb_identity(
    model: str,
    sizing: CBSizing,
    *,
    revision: str = "random-weights",
    dtype: str = "bfloat16",
    gpu_product: str = "",
    config: str = "",
) -> ArchiveIdentity:
    """The identity of a continuous-batching archive: the key set follows from the sizing."""
    q_sizes = sorted({k[0] for k in enumerate_keys(sizing)})
    return ArchiveIdentity(
        model=model,
        revision=revision,
        engine=ENGINE,
        engine_version=engine_version() or "unknown",
        capture_sizes=tuple(q_sizes),
        graph_mode="cb-varlen+decode" if sizing.decode_path else "cb-varlen",
        compile={
            "q_interval": str(sizing.q_padding_interval_size),
            "kv_interval": str(sizing.kv_padding_interval_size),
            "num_blocks": str(sizing.num_blocks),
            "block_size": str(sizing.block_size),
        },
        dtype=dtype,
        max_num_tokens=sizing.max_batch_tokens,
        max_batch=sizing.max_requests_per_batch,
        gpu_product=gpu_product,
        config=config,
        workload=dict(IDENTITY_WORKLOAD),
    )


def static_addresses(hooks: ManagerHooks) -> dict[str, int]:
    """Addresses the graphs bake in and LOAD must find again: weights, KV cache, static IO."""
    cache = hooks.processor.cache
    params = list(hooks.manager.model.parameters())
    out = {
        "param.first": params[0].data_ptr(),
        "param.last": params[-1].data_ptr(),
        "key_cache.first": cache.key_cache[0].data_ptr(),
        "value_cache.last": cache.value_cache[-1].data_ptr(),
    }
    for pair, io in enumerate(hooks.device_ios()):
        out[f"io{pair}.bulk"] = io._bulk_input_tensor.data_ptr()
        out[f"io{pair}.output_ids"] = io.output_ids.data_ptr()
        out[f"io{pair}.write_index"] = io.write_index_storage.data_ptr()
        out[f"io{pair}.read_index"] = io.read_index_storage.data_ptr()
        if io.attention_mask is not None:
            for layer_type, mask in io.attention_mask.items():
                out[f"io{pair}.mask.{layer_type}"] = mask.data_ptr()
    return out


class _ProofView:
    """What `ember.runtime.proof.prove.prove` needs, over the engine: state (KV cache) restored between
    replays, outputs compared bitwise (the sampled tokens), the captured graphs as reference."""

    def __init__(self, hooks: ManagerHooks, graphs: dict[tuple[int, ...], Any]) -> None:
        import torch

        self.graphs = graphs
        ios = hooks.device_ios()
        self.outs = {k: (ios[k[0]].output_ids,) for k in graphs}
        cache = hooks.processor.cache
        self._state = (*cache.key_cache, *cache.value_cache)
        # Distinct tokens and one logit row per request slot, so the compared tokens depend on
        # many positions of the forward pass (the synthetic capture batch had a single request).
        vocab = int(hooks.manager.model.config.get_text_config().vocab_size)
        gen = torch.Generator(device="cpu").manual_seed(3)
        for io in ios:
            # prove() poisons the outputs before each rebuilt launch and compares whole tensors; the
            # graphs write only the sampled rows, so the rest must start poisoned for the reference too.
            io.output_ids.view(torch.uint8).fill_(0xA5)
            n = io.input_ids.numel()
            io.input_ids.copy_(torch.randint(1, vocab, (n,), generator=gen, dtype=torch.int32))
            io.logits_indices.copy_(torch.arange(io.logits_indices.numel(), dtype=torch.int32))

    def state_tensors(self) -> tuple[Any, ...]:
        return self._state


class CBEngineAdapter:
    """One CBEngine (not started) behind the EngineAdapter protocol. `engine` may be bound later:
    LOAD opens the archive (check_version, accept) before the model exists."""

    kind = ENGINE

    def __init__(
        self,
        cb: CBEngine | None = None,
        *,
        model_name: str = "",
        sizing_overrides: Mapping[str, Any] | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        identity: ArchiveIdentity | None = None,
    ) -> None:
        self.cb = cb
        self.model_name = model_name
        self.sizing_overrides = dict(sizing_overrides or {})
        self.max_graphs = max_graphs
        self._identity = identity  # the SAVE Job's (the operator's name for the archive), if given
        self._canary: dict[str, Any] | None = None  # SAVE's (`facts`), read at install

    @property
    def engine(self) -> str:
        return compat_engine()

    @property
    def hooks(self) -> ManagerHooks:
        assert self.cb is not None and self.cb.hooks is not None, "prepare() first"
        return self.cb.hooks

    def check_version(self) -> list[str]:
        return check_engine()

    def keys(self) -> list[GraphKey]:
        return self.hooks.expected_keys()

    def identity(self) -> ArchiveIdentity:
        if self._identity is not None:
            return self._identity
        import torch

        return cb_identity(self.model_name, self.hooks.sizing, gpu_product=torch.cuda.get_device_name(),
                           config=self.config_digest())

    def config_digest(self) -> str:
        assert self.cb is not None
        return config_digest(self.cb.model.config.to_dict())

    def prepare(self, facts: Mapping[str, Any] | None) -> None:
        """The manager and its batch processor (KV cache, static IO): sized from the overrides at
        SAVE, from the archive's recorded sizing at LOAD (no memory-based sizing)."""
        assert self.cb is not None
        sizing = self.accept(facts) if facts is not None else None
        cb = self.cb
        config = cb_config_for(sizing) if sizing is not None else cb_config_for(None, **self.sizing_overrides)
        cb.manager = new_manager(cb.model, cb.gen_config, config)
        cb.hooks = ManagerHooks(cb.manager)
        if sizing is not None and cb.hooks.sizing != sizing:
            raise Refused(LOAD, f"engine resolved a different sizing: {cb.hooks.sizing} != archive {sizing}")

    def capture(self) -> dict[GraphKey, Any]:
        return self.hooks.capture_all(max_graphs=self.max_graphs)

    def proof_subject(self, graphs: Mapping[GraphKey, Any]) -> _ProofView:
        return _ProofView(self.hooks, dict(graphs))

    def facts(self, graphs: Mapping[GraphKey, Any]) -> dict[str, Any]:
        """The engine's sizing, the static addresses, and the canary LOAD checks itself with: the
        key its first request needs, what the NATIVE graph computes from the canary state."""
        from ember.runtime.graphs.need import need_order

        keys = list(graphs)
        first = keys[need_order(keys)[0]]
        canary = self.hooks.canary(first, lambda stream: graphs[first].replay())
        return {**self.hooks.engine_facts(), "inputs": static_addresses(self.hooks),
                "canary": {"kind": CANARY_KIND, "key": list(first), "fingerprint": canary}}

    def accept(self, facts: Mapping[str, Any]) -> CBSizing:
        if facts.get("kind") != ENGINE:
            raise Refused(COMPAT, f"archive is not a libember-saved {ENGINE} archive ({facts.get('kind')})")
        try:
            return CBSizing.from_json(facts["sizing"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(COMPAT, f"archive has no usable engine sizing: {exc}") from exc

    def static_addresses(self) -> dict[str, int]:
        return static_addresses(self.hooks)

    def install(self, library: GraphLibrary, archive: ArchiveContent) -> int:
        assert self.cb is not None
        self.cb.library = library  # keeps every exec and argument buffer alive while serving
        self._canary = archive.engine.get("canary")
        return self.hooks.install(library.all_restored())

    def verify(self, library: GraphLibrary) -> dict[str, Any]:
        """LOAD's canary (`ember.runtime.verify`): the first needed key's restored graph, through
        its template as instantiated, after an exec update and on its own exec (built on a thread
        meanwhile), against SAVE's native fingerprint of the same state (Refused on any
        difference; archives without one are not checked)."""
        from ember.runtime import verify
        from ember.runtime.graphs.driver import launch_exec

        index = library.order[0]
        key = library.keys[index]
        saved = self._canary
        if not saved or tuple(saved["key"]) != tuple(key):
            return {"verify": "skipped: the archive records no canary for its first key"}
        if saved.get("kind") != CANARY_KIND:
            kind = saved.get("kind", "cache word sums")
            raise Refused(COMPAT, f"the archive's canary is of another kind ({kind}; this engine checks "
                          f"{CANARY_KIND}): SAVE it again")

        split: dict[str, dict[str, float]] = {}  # per path, where its time went (hooks.canary)
        template_paths = iter(("template", "exec update"))  # graph_step's calls, in verify's order

        def graph_step() -> list[int]:
            times: dict[str, float] = {}
            split[next(template_paths, "exec update")] = times
            return self.hooks.canary(key, lambda stream: library.launch_template(index, stream), times=times)

        own = library.own.get_ahead(index)  # built while the template paths run on the GPU

        def own_exec_step() -> list[int]:
            times: dict[str, float] = {}
            split["own exec"] = times
            return self.hooks.canary(key, lambda stream: launch_exec(own.result(), stream), times=times)

        result = verify.canary(saved["fingerprint"], graph_step, lambda: None,
                               verify.round_trip(library, index), own_exec_step)
        result["parts_ms"].update({f"{path} {part}": round(ms, 2) for path, times in split.items()
                                   for part, ms in times.items()})
        return verify.settle(result, 1, 0)

    def report(self, stage: str, **fields: Any) -> None:
        log.info("%s: %s", stage, fields)


def save_engine(
    model: Any,
    gen_config: Any,
    sizing_overrides: dict[str, Any],
    store_uri: str | None,
    model_name: str,
    ip: Any = None,
    *,
    max_graphs: int = DEFAULT_MAX_GRAPHS,
    identity: ArchiveIdentity | None = None,
    log: Callable[[str], None] = print,
) -> tuple[SaveOutcome, CBEngine]:
    """Capture every key in the capture window, walk, prove, publish. Returns the pipeline's
    result and the (not started) engine holding the captured set, so the caller may serve from it.
    `identity`: the archive's name (the SAVE Job's), else `cb_identity` of the engine."""
    from ember.runtime.save import save

    cb = CBEngine(model)
    cb.gen_config = gen_config
    adapter = CBEngineAdapter(cb, model_name=model_name, sizing_overrides=sizing_overrides,
                              max_graphs=max_graphs, identity=identity)
    result = save(adapter, ip if ip is not None else _SESSION, store_uri, log=log)
    return result, cb


_EARLY: tuple[Path, Any] | None = None  # (archive dir, ArchiveRestore or Refused): open_early


def open_early(archive_dir: str | Path) -> None:
    """Open an archive that is on the node before the model is built (a pod that starts with its
    archive): its reconstruction then runs while the model builds, and `restore_into` with the
    same directory takes it over. A refusal is kept for restore_into."""
    global _EARLY
    restore: Any
    try:
        restore = _open(Path(archive_dir), _SESSION)
    except Refused as exc:
        restore = exc
    _EARLY = (Path(archive_dir).resolve(), restore)


def _open(archive_dir: Path, ip: Any) -> ArchiveRestore:
    from ember.handoff import archive_location
    from ember.runtime.load import open_restore

    try:
        store_uri, identity = archive_location(archive_dir)
    except ValueError as exc:
        raise Refused(LOAD, str(exc)) from exc
    return open_restore(CBEngineAdapter(), ip, store_uri, identity)


def _take_early(archive_dir: str | Path, ip: Any) -> ArchiveRestore:
    """The early-opened archive if it is this one (or its refusal), else a fresh open."""
    global _EARLY
    early, _EARLY = _EARLY, None
    if early is not None and early[0] == Path(archive_dir).resolve():
        if isinstance(early[1], Refused):
            raise early[1]
        return early[1]
    if early is not None and not isinstance(early[1], Refused):
        early[1].abandon()  # opened for another archive than the one handed over
    return _open(Path(archive_dir), ip)


def restore_into(engine: CBEngine, archive_dir: str | Path, ip: Any = None) -> StartInfo:
    """LOAD the archive into a not-yet-started CBEngine and start it; Refused on any refusal.

    The templates are built on a background thread (`ember.runtime.restore`) while the engine
    allocates its KV cache and static buffers (and while the model builds, after open_early)."""
    from ember.runtime.load import load

    t0 = time.perf_counter()
    restore = _take_early(archive_dir, ip if ip is not None else _SESSION)
    t_compat = time.perf_counter() - t0
    adapter = CBEngineAdapter(engine)
    try:
        restored = load(adapter, restore)
    except Refused:
        _abandon(engine)
        raise
    t_load = time.perf_counter() - t0 - t_compat
    sizing = adapter.hooks.sizing.to_json()
    seconds = {"compat": t_compat, "manager": restored.timings["prepare_ms"] / 1e3, "load": t_load}
    info = StartInfo("restored", seconds, graphs=restored.graphs, sizing=sizing)
    info.seconds.update({f"restore.{k}": v / 1e3 for k, v in restored.timings.items() if k.endswith("_ms")})
    parts = restored.timings.get("verify_parts") or {}  # where the canary's time went
    info.seconds.update({f"restore.verify.{k}": v / 1e3 for k, v in parts.items()})
    engine.start(info)
    return info


def _abandon(engine: CBEngine) -> None:
    """Drop a half-built restored engine so a native start gets its memory back."""
    import torch

    engine.manager, engine.hooks, engine.library = None, None, None
    gc.collect()
    torch.cuda.empty_cache()
