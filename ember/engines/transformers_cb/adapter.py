"""SAVE and LOAD of transformers continuous-batching graphs through ember's graph runtime.

The same building blocks as `ember.runtime.save` / `ember.runtime.load` (libember session and
capture window, GraphWalker, prove, publish, compat, GraphLibrary), with the engine in place of
the built-in decode workload:

SAVE (process under LD_PRELOAD=libember.so EMBER_MODE=save EMBER_ARM=manual)::

    ip = session("save")                        # arm BEFORE the model is built
    model = build_model(...)
    outcome = save_engine(model, gen_config, sizing_overrides, store_uri, model_name, ip)

LOAD (fresh process, EMBER_MODE=load)::

    ip = session("load")                        # arm BEFORE the model is built
    model = build_model(...)                    # same allocations, same order as SAVE
    engine = CBEngine(model)
    info = restore_into(engine, archive_dir)    # raises RestoreRefused → capture natively

LOAD checks, in order, before anything launches: the compatibility key, the engine facts (kind,
version, sizing), blob digests, the static buffers' addresses against SAVE's, the capture
window's allocation replay; then one template per topology group is instantiated and every key
is installed in the engine's graph buffers.
"""

from __future__ import annotations

import gc
import importlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.engines.transformers_cb.facts import cb_identity
from ember.engines.transformers_cb.hooks import ENGINE, CBAdapter, cb_config_for, engine_version, new_manager
from ember.engines.transformers_cb.keys import CBSizing

_SESSION: Any = None


class RestoreRefused(RuntimeError):
    """LOAD refused at `stage` ("compat" or "load"); the caller captures natively."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


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
    for name in ("restore", "publish", "library", "compat"):
        importlib.import_module(f"ember.runtime.{name}")


def static_addresses(adapter: CBAdapter) -> dict[str, int]:
    """Addresses the graphs bake in and LOAD must find again: weights, KV cache, static IO."""
    cache = adapter.processor.cache
    params = list(adapter.manager.model.parameters())
    out = {
        "param.first": params[0].data_ptr(),
        "param.last": params[-1].data_ptr(),
        "key_cache.first": cache.key_cache[0].data_ptr(),
        "value_cache.last": cache.value_cache[-1].data_ptr(),
    }
    for pair, io in enumerate(adapter.device_ios()):
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

    def __init__(self, adapter: CBAdapter, graphs: dict[tuple[int, ...], Any]) -> None:
        import torch

        self.graphs = graphs
        ios = adapter.device_ios()
        self.outs = {k: (ios[k[0]].output_ids,) for k in graphs}
        cache = adapter.processor.cache
        self._state = (*cache.key_cache, *cache.value_cache)
        # Distinct tokens and one logit row per request slot, so the compared tokens depend on
        # many positions of the forward pass (the synthetic capture batch had a single request).
        vocab = int(adapter.manager.model.config.get_text_config().vocab_size)
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


def save_engine(
    model: Any,
    gen_config: Any,
    sizing_overrides: dict[str, Any],
    store_uri: str | None,
    model_name: str,
    ip: Any = None,
    *,
    max_graphs: int = 512,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture every key in the capture window, walk, prove, publish. Returns a summary with the
    manager/adapter still alive (key "engine") so the caller may serve from the captured set."""
    import torch

    from ember.runtime import compat, publish
    from ember.runtime.graphs.kernels import LiveResolver, NativeResolver
    from ember.runtime.graphs.walk import GraphWalker
    from ember.runtime.proof.prove import ProofFailed, prove
    from ember.runtime.save import execution_order

    ip = ip if ip is not None else _SESSION
    d: dict[str, float] = {}
    t = time.perf_counter()
    manager = new_manager(model, gen_config, cb_config_for(None, **sizing_overrides))
    adapter = CBAdapter(manager)
    d["engine_s"] = time.perf_counter() - t
    if ip is not None:
        ip.capture_begin()
    t = time.perf_counter()
    graphs = adapter.capture_all(max_graphs=max_graphs)
    torch.cuda.synchronize()
    d["capture_s"] = time.perf_counter() - t
    if ip is not None:
        ip.capture_end()
    log(f"Captured {len(graphs)} graphs in {d['capture_s']:.2f} s")

    resolver = NativeResolver(ip) if ip is not None else LiveResolver()
    t = time.perf_counter()
    walker = GraphWalker(resolver)
    walked = [walker.walk(g.raw_cuda_graph(), key) for key, g in graphs.items()]
    graph_set = walker.graph_set(walked)
    d["walk_s"] = time.perf_counter() - t
    missing = [k for k in graph_set.kernels if not k.image]
    if missing:
        raise ProofFailed(f"{len(missing)} kernels have no catalog entry, e.g. {missing[0].name}")
    # The kernels' node params are captured; what the proof compares are sampled tokens.
    t = time.perf_counter()
    view = _ProofView(adapter, graphs)
    rep, table_blob, lib = prove(view, graph_set, lambda refs: [resolver.function(r) for r in refs])  # type: ignore[arg-type]
    d["prove_s"] = time.perf_counter() - t
    templates = [g.template for g in lib.groups]
    lib.close()
    if not rep.ok:
        raise ProofFailed("archive NOT published: " + "; ".join(rep.mismatches[:5]))
    log(f"Proved {rep.graphs} graphs ({rep.templates} templates) bit-identical in {rep.seconds:.2f} s")

    sizing = adapter.sizing
    identity = cb_identity(model_name, sizing, gpu_product=torch.cuda.get_device_name())
    images: list[Any] = []
    if ip is not None:
        catalog = {e["hash"]: e for e in ip.catalog()}
        per_image: dict[str, int] = {}
        for k in graph_set.kernels:
            per_image[k.image] = per_image.get(k.image, 0) + 1
        for h in execution_order(graph_set, templates):
            e = catalog.get(h, {})
            opts = {"jit": e.get("jit_options", {}), "library": e.get("library_options", {})}
            images.append(
                publish.Image(h, ip.image_bytes(h), e.get("kind", "unknown"), opts, per_image.get(h, 0))
            )
    facts = {
        **adapter.engine_facts(),
        "inputs": static_addresses(adapter),
        "graphs": len(graphs),
        "in_process_only": ip is None,
        "region": list(ip.region()) if ip is not None else None,
    }
    summary: dict[str, Any] = {
        "graphs": len(graphs),
        "groups": rep.templates,
        "identity": identity.hash(),
        "durations": d,
        "published": False,
        "engine": (manager, adapter, graphs),
        "graph_stats": {"nodes": sum(len(g.nodes) for g in walked), "kernels": len(graph_set.kernels)},
    }
    if store_uri is not None and ip is not None:
        archive = publish.Archive(
            identity=identity,
            compat=compat.current(compat_engine()),
            graph_table=table_blob,
            images=images,
            alloc_log=ip.export_alloc_log(),
            engine=facts,
        )
        t = time.perf_counter()
        uri, digest, size = publish.write(store_uri, archive, graph_set)
        summary["manifest"], summary["manifest_digest"], summary["bytes"] = uri, digest, size
        d["publish_s"] = time.perf_counter() - t
        summary["published"] = True
        log(f"Published {summary['manifest']} ({summary['bytes'] / 1e6:.1f} MB)")
    elif store_uri is not None:
        summary["reason"] = (
            "not published: libember is not preloaded (EMBER_MODE=save), LOAD could not find kernels"
        )
    return summary


def store_of(archive_dir: str | Path) -> tuple[str, str]:
    """(store URI, identity hash) of `<store>/archives/<hash>` (the sidecar's cache layout)."""
    path = Path(archive_dir).absolute()
    if path.name == "manifest":
        path = path.parent
    if path.parent.name != "archives":
        raise RestoreRefused("load", f"{archive_dir} is not <store>/archives/<identity-hash>")
    return path.parent.parent.as_uri(), path.name


_EARLY: tuple[Path, Any] | None = None  # (archive dir, ArchiveRestore or RestoreRefused): open_early


def open_early(archive_dir: str | Path) -> None:
    """Open an archive that is on the node before the model is built (a pod that starts with its
    archive): its reconstruction then runs while the model builds, as the decode LOAD does, and
    `restore_into` with the same directory takes it over. A refusal is kept for restore_into."""
    global _EARLY
    restore: Any
    try:
        restore = _open(Path(archive_dir), _SESSION)
    except RestoreRefused as exc:
        restore = exc
    _EARLY = (Path(archive_dir).resolve(), restore)


def _open(archive_dir: Path, ip: Any) -> Any:
    """ArchiveRestore.open with the CB engine's checks (kind, sizing); RestoreRefused."""
    from ember.runtime.restore import ArchiveRestore, LoadRefused

    store_uri, identity = store_of(archive_dir)

    def accept(facts: dict[str, Any]) -> CBSizing:
        if facts.get("kind") != ENGINE:
            kind = facts.get("kind")
            raise LoadRefused(f"archive is not a libember-saved {ENGINE} archive ({kind})", "compat")
        try:
            return CBSizing.from_json(facts["sizing"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LoadRefused(f"archive has no usable engine sizing: {exc}", "compat") from exc

    try:
        return ArchiveRestore.open(ip, store_uri, identity, compat_engine(), accept=accept)
    except LoadRefused as exc:
        raise RestoreRefused(exc.stage, exc.reason) from exc


def restore_into(engine: Any, archive_dir: str | Path, ip: Any = None) -> Any:
    """LOAD the archive into a not-yet-started CBEngine and start it; RestoreRefused on any refusal.

    The templates are built on a background thread (`ember.runtime.restore`) while the engine
    allocates its KV cache and static buffers (and while the model builds, after open_early)."""
    from ember.runtime.restore import LoadRefused

    global _EARLY
    ip = ip if ip is not None else _SESSION
    t0 = time.perf_counter()
    early, _EARLY = _EARLY, None
    if early is not None and early[0] == Path(archive_dir).resolve():
        if isinstance(early[1], RestoreRefused):
            raise early[1]
        restore = early[1]
    else:
        if early is not None and not isinstance(early[1], RestoreRefused):
            early[1].abandon()  # opened for another archive than the one handed over
        restore = _open(Path(archive_dir), ip)
    facts = dict(restore.manifest.engine)
    t_compat = time.perf_counter() - t0

    def load(adapter: CBAdapter) -> dict[tuple[int, ...], Any]:
        here = static_addresses(adapter)
        moved = {
            k: (hex(v), hex(here.get(k, 0))) for k, v in facts.get("inputs", {}).items() if here.get(k) != v
        }
        if moved:
            raise RestoreRefused("load", f"static buffers are not where SAVE had them: {moved}")
        try:
            restore.replay()
            lib = restore.library()
        except LoadRefused as exc:
            raise RestoreRefused(exc.stage, exc.reason) from exc
        engine.library = lib  # keeps every exec and argument buffer alive while serving
        return lib.all_restored()

    try:
        info = engine.start_restored(restore.accepted, load)
    except RestoreRefused:
        restore.abandon()
        _abandon(engine)
        raise
    except Exception as exc:
        restore.abandon()
        _abandon(engine)
        raise RestoreRefused("load", f"{type(exc).__name__}: {exc}") from exc
    info.seconds["compat"] = t_compat
    info.seconds["load"] = time.perf_counter() - t0 - t_compat
    info.seconds.update({f"restore.{k}": v / 1e3 for k, v in restore.timings.items() if k.endswith("_ms")})
    return info


def _abandon(engine: Any) -> None:
    """Drop a half-built restored engine so a native start gets its memory back."""
    import torch

    engine.manager, engine.adapter, engine.library = None, None, None
    gc.collect()
    torch.cuda.empty_cache()
