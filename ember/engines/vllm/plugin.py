"""ember's `vllm.general_plugins` entry point: SAVE and LOAD inside vLLM's own worker.

vLLM runs `register()` in every process it starts (front-end, engine core, workers, its
model-inspection subprocess), so it is cheap and re-entrant: it only waits for the GPU worker's
module to be imported (`after_import`). With `EMBER_MODE` unset (or `EMBER_VLLM=0`) it does nothing
but optional stage timing; with `EMBER_MODE=save|load` (libember preloaded, `EMBER_ARM=manual`) and
a vLLM whose internals the adapter knows (`versions.check_engine`), it patches, in the processes
that run a GPU worker only:

- the V1 and V2 `GPUModelRunner.__init__`: arm libember first (everything the runner and the model
  allocate is then at SAVE's addresses); at LOAD also open the archive there (manifest,
  compatibility key, allocation log; the templates build in the background while vLLM builds the
  model, compiles from its cache and allocates the KV cache) and set
  `cache_config.kv_cache_memory_bytes` from it, so vLLM skips memory profiling;
- the V1 and V2 `GPUModelRunner.capture_model`: SAVE runs `ember.runtime.save.save` around the
  engine's own capture; LOAD runs `ember.runtime.load.load` INSTEAD of it. Any refusal runs the
  original capture (vLLM unchanged), with the reason in the report.

Environment: `EMBER_VLLM_STORE` (SAVE: store URI to publish to), `EMBER_VLLM_ARCHIVE` (LOAD:
`<store>/archives/<identity-hash>`), `EMBER_VLLM_MODEL` (model name in the identity),
`EMBER_VLLM_REPORT` (a JSON file the report is written to; the stages also go to the log),
`EMBER_VLLM_PROBE=1` (with the report: end the process once `determine_available_memory` has
returned and been reported; the SAVE Job sizes the KV cache this way).
SAVE needs `kv_cache_memory_bytes` set (vLLM's `--kv-cache-memory-bytes`, or
`VLLM_ENABLE_STARTUP_PLAN=1` after a native start): memory profiling allocates, and LOAD, which
skips it, must allocate exactly as SAVE did.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember import settings

log = logging.getLogger("ember.vllm")

RUNNERS = {"v1": "vllm.v1.worker.gpu_model_runner", "v2": "vllm.v1.worker.gpu.model_runner"}
WORKER_MODULE = "vllm.v1.worker.gpu_worker"  # imported only where a GPU worker runs
WORKER_STAGES = (
    "init_device",
    "load_model",
    "determine_available_memory",
    "initialize_from_config",
    "compile_or_warm_up_model",
)
T0 = time.time()


@dataclass
class _State:
    mode: str = ""
    installed: bool = False
    armed: bool = False
    ip: Any = None
    restore: Any = None
    refusal: str = ""
    keep: Any = None
    report: dict[str, Any] = field(default_factory=dict)
    warm_up_timed: bool = False  # the worker's stages are wrapped: SAVE publishes after its warm-up
    unpublished: Any = None  # SAVE's outcome until then
    replica: tuple[int, int] | None = None  # a worker's DP replica of a dense model (report.replica)


STATE = _State()


def report(stage: str, *, flush: bool = True, **fields: Any) -> None:
    """Record a stage (log + `EMBER_VLLM_REPORT`, ember.engines.vllm.report): "t" is seconds since
    this process loaded the plugin. `flush=False`: kept for this process's next write (a worker
    before its rank is known would write the file its peers and the engine core share)."""
    from ember.engines.vllm import report as reports

    STATE.report.setdefault("stages", {})[stage] = {"t": round(time.time() - T0, 4), **fields}
    log.info("ember %s: %s", stage, json.dumps(fields, default=str)[:2000])
    path = os.environ.get("EMBER_VLLM_REPORT")
    if path and flush:
        reports.write(path, STATE.report, reports.worker_rank(STATE.replica))


def register() -> None:
    """The entry point (group `vllm.general_plugins`, name `ember`). vLLM also runs it in processes
    that never build a model (the API server parsing arguments, its model-inspection subprocess):
    the worker's modules are checked and patched only once this process imports them."""
    if not settings.on("EMBER_VLLM") or STATE.installed:
        return
    mode = os.environ.get("EMBER_MODE", "off")
    timing = bool(os.environ.get("EMBER_VLLM_REPORT"))
    if mode not in ("save", "load") and not timing:
        return
    STATE.installed = True
    STATE.mode = mode if mode in ("save", "load") else ""
    if STATE.mode or settings.on("EMBER_VLLM_PROBE"):
        from ember.engines.vllm.compile_cache import own_triton_home

        # before any Triton compile: what SAVE compiles there ships, and what the SAVE Job's sizing
        # probe compiles (same cache root, same ptxas) SAVE finds instead of compiling it again
        own_triton_home()
    if STATE.mode == "load":
        place_caches()
    if WORKER_MODULE in sys.modules:
        _install()
    else:
        after_import(WORKER_MODULE, _install)


def place_caches() -> None:
    """LOAD, in the first vLLM process (plugins load in `EngineArgs.__post_init__`): the archive's
    vLLM caches put under this process's cache root before vLLM reads them (not those of an
    archive LOAD refuses for its code, `parallel.archive_refusal`: vLLM would run that code).
    The model-class facts are read while the engine's config is built, long before a worker
    exists; without them vLLM inspects the class in a subprocess that imports vLLM (~20 s). Once
    per process tree (`compile_cache.PLACED`); a failure here leaves it to the runner's
    `attached()`, which refuses then."""
    from ember.engines.vllm import compile_cache
    from ember.engines.vllm.parallel import archive_refusal
    from ember.handoff import archive_location
    from ember.runtime import publish

    archive = os.environ.get("EMBER_VLLM_ARCHIVE", "")
    if not archive or compile_cache.placed_here():
        return
    try:
        opened = publish.open_archive(*archive_location(archive))
        tensor = int(opened.manifest.identity.parallelism.tensor)
        if why := archive_refusal(tensor, opened.manifest.engine):  # the runner's accept() refuses too
            report("compile_cache", refused=why, process="plugin")
            return
        data = opened.attachment(compile_cache.NAME)
        if data:
            report("compile_cache", **compile_cache.unpack(data), process="plugin")
        os.environ[compile_cache.PLACED] = str(compile_cache.cache_root())  # vLLM's processes inherit it
    except Exception as exc:  # the runner's open reads the archive again and refuses with its reason
        report("compile_cache_early", error=f"{type(exc).__name__}: {exc}")


def _refuse_all(problems: list[str]) -> None:
    STATE.refusal = "; ".join(problems)
    report("refused", at="engine", reason=STATE.refusal, note="vLLM left untouched")


def _install() -> None:
    """In a process that runs a GPU worker: check every touch point, then patch. It runs inside
    vLLM's import of the worker module: whatever goes wrong is a refusal, never the import's."""
    from ember.engines.vllm import memtrace
    from ember.engines.vllm.versions import check_engine

    try:
        problems = check_engine()
        if not problems:
            _time_worker_stages()
            if STATE.mode:
                _set_device_without_allocating()
            if STATE.mode == "load" and settings.on("EMBER_VLLM_ONE_GPU"):
                _one_gpu_per_worker()
            if memtrace.folder() is not None:
                _trace_from_distributed_init()
            for kind, module in RUNNERS.items():
                _patch_runner(module, kind)
    except Exception as exc:
        problems = [f"installing the plugin failed: {type(exc).__name__}: {exc}"]
    if problems:
        _refuse_all(problems)


def after_import(name: str, then: Callable[[], None]) -> None:
    """Run `then()` right after module `name` is first imported (it is not imported yet)."""

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)  # the real finders' spec
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module: Any) -> None:
                    run(module)
                    then()

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Hook())


def _time_worker_stages() -> None:
    """Seconds of each start-up stage of the GPU worker (`report("worker.<stage>")`)."""
    from vllm.v1.worker import gpu_worker

    from ember.runtime.stacks import dumped_while_stuck

    for name in WORKER_STAGES:
        original = getattr(gpu_worker.Worker, name)

        def timed(self: Any, *a: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            from ember.engines.vllm.report import replica

            STATE.replica = replica(getattr(self, "parallel_config", None))
            t = time.perf_counter()
            try:
                with dumped_while_stuck():  # a stage waiting on a peer for ever says where
                    out = _original(self, *a, **kw)
            except BaseException as exc:  # in the report: on N ranks a peer may wait for this one forever
                report(f"worker.{_name}", seconds=round(time.perf_counter() - t, 4),
                       error=f"{type(exc).__name__}: {exc}"[:2000])
                _trace(f"failed-{_name}")
                raise
            _trace(f"after-{_name}")
            extra: dict[str, Any] = {"bytes": int(out)} if _name == "determine_available_memory" else {}
            report(f"worker.{_name}", seconds=round(time.perf_counter() - t, 4), **extra)
            if extra and settings.on("EMBER_VLLM_PROBE"):
                os._exit(0)  # the SAVE Job's sizing probe (ember.engines.vllm.job): the figure is written
            if _name == "compile_or_warm_up_model":
                publish_saved()
            return out

        setattr(gpu_worker.Worker, name, timed)
    STATE.warm_up_timed = True


def publish_saved() -> None:
    """SAVE's archive published once vLLM's warm-up is done: the warm-up, after the graphs are
    captured, compiles vLLM's own Triton kernels (the model runner's, the sampler's), and they ship
    in the archive's compile cache, so a LOAD compiles none. A failed warm-up publishes nothing."""
    outcome, STATE.unpublished = STATE.unpublished, None
    if outcome is None or outcome.publish_now is None:
        return
    t = time.perf_counter()
    try:
        outcome.publish_now()
    except Exception as exc:  # the store refused it: nothing half-published (publish.write)
        report("save_refused", reason=f"publishing: {type(exc).__name__}: {exc}")
        return
    seconds = (STATE.report.get("stages", {}).get("save") or {}).get("seconds")
    report("save", **outcome.summary(), seconds=seconds,
           publish_after_warm_up_s=round(time.perf_counter() - t, 4))


def _one_gpu_per_worker() -> None:
    """LOAD on N GPUs: each worker sees its own GPU only, as index 0 (ember.engines.vllm.devices)."""
    from vllm.v1.worker import gpu_worker

    from ember.engines.vllm import devices

    original = gpu_worker.Worker.init_device

    def init_device(self: Any, *a: Any, **kw: Any) -> Any:
        try:
            if done := devices.one_gpu(self):
                report("one_gpu", flush=False, done=done)
        except Exception as exc:  # left as vLLM sets it: LOAD refuses a rank on another index
            report("one_gpu", flush=False, error=f"{type(exc).__name__}: {exc}")
        return original(self, *a, **kw)

    gpu_worker.Worker.init_device = init_device


def _set_device_without_allocating() -> None:
    """SAVE and LOAD alike: vLLM's `set_device` allocates nothing (ember.engines.vllm.devices)."""
    from vllm.platforms import cuda

    from ember.engines.vllm.devices import set_device_eagerly

    def set_device(cls: Any, device: Any) -> None:
        set_device_eagerly(device)

    cuda.CudaPlatformBase.set_device = classmethod(set_device)  # type: ignore[method-assign,assignment]


def _trace_from_distributed_init() -> None:
    """EMBER_VLLM_MEMORY_TRACE: torch's allocation history from the worker's distributed set-up on."""
    from vllm.v1.worker import gpu_worker

    from ember.engines.vllm import memtrace

    original = gpu_worker.init_worker_distributed_environment

    def traced(*a: Any, **kw: Any) -> Any:
        memtrace.start()
        return original(*a, **kw)

    gpu_worker.init_worker_distributed_environment = traced


def _trace(tag: str) -> None:
    """EMBER_VLLM_MEMORY_TRACE: this worker's allocation history so far, to compare SAVE with LOAD."""
    from ember.engines.vllm import memtrace
    from ember.engines.vllm import report as reports

    if memtrace.folder() is None:
        return
    try:
        rank = reports.worker_rank(STATE.replica)
        path = memtrace.dump(STATE.mode, rank[0] if rank else 0, tag)
        report(f"memtrace.{tag}", path=str(path))
    except Exception as exc:  # a diagnostic never fails the engine
        report(f"memtrace.{tag}", error=f"{type(exc).__name__}: {exc}")


def _patch_runner(module_name: str, kind: str) -> None:
    import importlib

    cls = importlib.import_module(module_name).GPUModelRunner
    init, capture = cls.__init__, cls.capture_model

    def __init__(self: Any, vllm_config: Any, device: Any, *a: Any, **kw: Any) -> None:
        _before_runner(vllm_config, kind)
        init(self, vllm_config, device, *a, **kw)

    def capture_model(self: Any) -> int:
        try:
            return _capture_model(self)
        finally:
            watch_graph_captures()

    def _capture_model(self: Any) -> int:
        t = time.perf_counter()
        if STATE.mode == "load" and (STATE.refusal or not STATE.armed):
            _vote_no(self, kind)  # its peers LOAD: they hear of this rank's refusal before restoring
        if not STATE.mode or STATE.refusal or not STATE.armed:
            out = capture(self)
            report("capture", how="native", seconds=round(time.perf_counter() - t, 4), reason=STATE.refusal)
            return int(out or 0)
        if STATE.mode == "save":
            return _save(self, kind, lambda: capture(self))
        return _load(self, kind, lambda: capture(self))

    cls.__init__, cls.capture_model = __init__, capture_model


def watch_graph_captures() -> None:
    """The graphs vLLM counts as captured (`compilation_counter.num_cudagraph_captured`) once
    start-up has captured or restored them (`cudagraphs.at_start`), and every capture after that
    (`cudagraphs.serving`, reported as it happens: the goal is none). Only a write of that counter
    is watched, so serving pays nothing while no graph is captured."""
    try:
        from vllm.compilation.counter import compilation_counter
    except ImportError:
        return
    start = int(compilation_counter.num_cudagraph_captured)
    report("cudagraphs", at_start=start, serving=0)
    cls: Any = type(compilation_counter)
    cls._ember_start = start  # a later start-up (a second capture_model) counts from its own
    if getattr(cls, "_ember_watched", False):
        return
    setattr_ = cls.__setattr__

    def counted(obj: Any, name: str, value: Any) -> None:
        setattr_(obj, name, value)
        first = int(type(obj)._ember_start)
        if name == "num_cudagraph_captured" and obj is compilation_counter and int(value) > first:
            report("cudagraphs", at_start=first, serving=int(value) - first)

    cls.__setattr__ = counted
    cls._ember_watched = True


def _vote_no(runner: Any, kind: str) -> None:
    """A rank that will capture natively tells its peers (LOAD on N ranks: VllmAdapter.vote)."""
    from ember.engines.vllm.adapter import VllmAdapter

    try:
        VllmAdapter(runner, runner_kind=kind).vote(False)
    except Exception as exc:  # a world of one, or no vLLM groups: nobody to tell
        report("vote", error=f"{type(exc).__name__}: {exc}")


def _parallel_before_model(vllm_config: Any) -> None:
    """A tensor-parallel shape: the embedding's shard bounds in device memory (SAVE, its probe and
    LOAD alike, ember.engines.vllm.parallel) before vLLM builds the model."""
    if int(vllm_config.parallel_config.tensor_parallel_size) > 1:
        from ember.engines.vllm.parallel import patch_vocab_embedding

        patch_vocab_embedding()


def _arm(vllm_config: Any) -> Any:
    """libember armed on this worker's device (None when it is not preloaded)."""
    import torch

    from ember import native
    from ember.runtime.session import ensure_context, preloaded

    ensure_context(torch.cuda.current_device())
    if not preloaded():
        return None
    ip = native.Interposer.attach()
    if ip.mode != STATE.mode:
        raise RuntimeError(f"libember is in mode {ip.mode!r}, EMBER_MODE says {STATE.mode!r}")
    ip.arm()
    return ip


def _before_runner(vllm_config: Any, kind: str) -> None:
    """Arm libember (before the runner and model allocate); LOAD: open the archive."""
    from ember.engines.vllm.adapter import VllmAdapter

    if not STATE.mode:
        if settings.on("EMBER_VLLM_PROBE"):  # its compile fills the cache SAVE loads: SAVE's model code
            _parallel_before_model(vllm_config)
        return
    if STATE.armed or STATE.refusal:
        if STATE.armed:
            STATE.refusal = "a second model runner in this process (drafter?): not supported"
        return
    adapter = VllmAdapter(vllm_config=vllm_config, runner_kind=kind)
    problems = adapter.check_version()
    if problems:
        STATE.refusal = "; ".join(problems)
        report("refused", at="engine", reason=STATE.refusal)
        return
    _parallel_before_model(vllm_config)
    STATE.ip = _arm(vllm_config)
    STATE.armed = STATE.ip is not None
    if not STATE.armed:
        STATE.refusal = "libember is not preloaded (LD_PRELOAD=libember.so EMBER_MODE=...)"
        report("refused", at="engine", reason=STATE.refusal)
        return
    report("armed", mode=STATE.mode, runner=kind)
    _trace("armed")
    if STATE.mode == "save" and not vllm_config.cache_config.kv_cache_memory_bytes:
        STATE.refusal = (
            "SAVE needs kv_cache_memory_bytes (memory profiling allocates; LOAD skips it and "
            "must allocate as SAVE did): pass --kv-cache-memory-bytes"
        )
        report("refused", at="save", reason=STATE.refusal)
    if STATE.mode == "load":
        STATE.restore = _open_agreed(adapter)
        if STATE.restore is None:
            return
        facts = STATE.restore.manifest.engine
        vllm_config.cache_config.kv_cache_memory_bytes = int(facts["kv_cache_memory_bytes"])
        report(
            "compat",
            kv_cache_memory_bytes=int(facts["kv_cache_memory_bytes"]),
            timings={k: round(v, 2) for k, v in STATE.restore.timings.items() if isinstance(v, float)},
        )


def _open_agreed(adapter: Any) -> Any:
    """LOAD: the archive opened, and on N ranks every rank's verdict taken before any of them
    sizes its KV cache; None (refused, reported) unless every rank opened it. A rank refused alone
    here would leave `kv_cache_memory_bytes` unset, and vLLM would profile its graph memory (V1's
    `profile_cudagraph_memory`: warm-up steps with real collectives) while its peers, whose size
    the archive gives, never join them. (Refusals before this point, a vLLM version or libember
    not preloaded, are the same on every rank: each such rank votes no at its capture instead.)"""
    from ember.engines.vllm.adapter import PEER_REFUSED
    from ember.runtime.adapter import LOAD, Refused

    try:
        restore = _open(adapter)
    except Exception as exc:  # Refused, or anything else: never a rank that skips the vote
        refused = exc if isinstance(exc, Refused) else Refused(LOAD, f"{type(exc).__name__}: {exc}")
        restore, STATE.refusal = None, f"{refused.stage}: {refused.reason}"
        report("refused", at=refused.stage, reason=refused.reason)
    if not adapter.vote(restore is not None) and restore is not None:  # one GPU: its own verdict
        restore.abandon()
        restore, STATE.refusal = None, f"{LOAD}: {PEER_REFUSED}"
        report("refused", at=LOAD, reason=PEER_REFUSED)
    return restore


def _open(adapter: Any) -> Any:
    from ember.handoff import archive_location
    from ember.runtime.adapter import LOAD, Refused
    from ember.runtime.load import open_restore

    try:
        store_uri, identity = archive_location(os.environ.get("EMBER_VLLM_ARCHIVE", ""))
    except ValueError as exc:
        raise Refused(LOAD, f"EMBER_VLLM_ARCHIVE: {exc}") from exc
    restore = open_restore(adapter, STATE.ip, store_uri, identity)
    try:
        _own_rank_cache(adapter.vllm_config, restore.manifest.engine)
    except BaseException:  # the opened restore's background work stopped before the refusal
        restore.abandon()
        raise
    return restore


def _own_rank_cache(vllm_config: Any, facts: dict[str, Any]) -> None:
    """vLLM keeps compiled code per rank (`rank_<rank>_<dp rank>/`); SAVE compiled as the rank it
    played, whose code every rank runs (the graphs are that code's launches): this rank's
    directory is a copy of it where vLLM has none. Refused on a device index other than SAVE's:
    the code names its device (ember.engines.vllm.devices)."""
    import torch

    from ember.engines.vllm import compile_cache
    from ember.engines.vllm.devices import device_refusal
    from ember.runtime.adapter import LOAD, Refused

    if why := device_refusal(int(facts.get("device_index", 0)), int(torch.cuda.current_device())):
        raise Refused(LOAD, why)
    pc = vllm_config.parallel_config
    here = f"rank_{int(pc.rank)}_{int(getattr(pc, 'data_parallel_index', 0) or 0)}"
    if copied := compile_cache.alias_rank(str(facts.get("compile_cache_key") or ""), here):
        report("compile_cache_rank", copied=copied, rank_dir=here)


def _save(runner: Any, kind: str, native: Any) -> int:
    import torch

    from ember.engines.vllm.adapter import VllmAdapter
    from ember.runtime.save import save

    t = time.perf_counter()
    adapter = VllmAdapter(runner, runner_kind=kind, native_capture=native)
    store = os.environ.get("EMBER_VLLM_STORE") or None
    try:
        with torch.inference_mode():  # the engine's tensors are inference tensors
            outcome = save(adapter, STATE.ip, store, log=_progress, publish_later=STATE.warm_up_timed)
        STATE.unpublished = outcome if outcome.publish_now else None
        report("save", **outcome.summary(), seconds=round(time.perf_counter() - t, 4))
    except Exception as exc:  # Refused, ProofFailed or a site the adapter does not know
        report("save_refused", reason=f"{type(exc).__name__}: {exc}", captured=len(adapter.captured))
        if not adapter.captured and adapter.graph_bytes == 0:
            return int(native() or 0)
    report("capture", how="save", seconds=round(time.perf_counter() - t, 4), graphs=len(adapter.captured))
    return adapter.graph_bytes


def _progress(message: str) -> None:
    """SAVE's steps in the report as it reaches them: a SAVE that never ends shows how far it got."""
    log.info("ember: %s", message)
    report("save_progress", last=message)


def _load(runner: Any, kind: str, native: Any) -> int:
    import torch

    from ember.engines.vllm.adapter import VllmAdapter
    from ember.runtime.adapter import LOAD, Refused
    from ember.runtime.load import load

    t = time.perf_counter()
    adapter = VllmAdapter(runner, runner_kind=kind)
    try:
        if settings.on("EMBER_VLLM_CAPTURE_NATIVELY"):  # every rank alike: they all vote no
            STATE.restore.abandon()
            raise Refused(LOAD, "EMBER_VLLM_CAPTURE_NATIVELY=1: vLLM captures (a restore's reference)")
        with torch.inference_mode():
            restored = load(adapter, STATE.restore)
        _after_install(kind)
    except Refused as exc:
        STATE.refusal = f"{exc.stage}: {exc.reason}"
        adapter.uninstall()  # a canary's refusal comes after install: vLLM must capture, not replay
        if adapter.canary:
            report("verify", **verify_fields(adapter.canary))
        report("load_refused", at=exc.stage, reason=exc.reason)
        _trace("refused")
        if adapter.voted is None:  # refused before its vote: its peers hear of it (VllmAdapter.vote)
            adapter.vote(False)
        t = time.perf_counter()
        out = native()
        report("capture", how="native-after-refusal", seconds=round(time.perf_counter() - t, 4))
        return int(out or 0)
    STATE.keep = adapter  # keeps the templates (and every exec) alive while serving
    timings = {k: round(v, 2) for k, v in restored.timings.items() if isinstance(v, float)}
    report("verify", **verify_fields(adapter.canary))
    report("load", graphs=restored.graphs, seconds=round(time.perf_counter() - t, 4), timings=timings)
    report("capture", how="restored", seconds=round(time.perf_counter() - t, 4), graphs=restored.graphs)
    return 0


def verify_fields(result: dict[str, Any]) -> dict[str, Any]:
    """LOAD's canary in the report: its verdict, cost (ms) and where the time went, what it checked."""
    return {"ok": bool(result.get("ok")), "verify_ms": round(float(result.get("verify_ms") or 0.0), 2),
            "parts_ms": result.get("parts_ms") or {}, "checked": result.get("checked") or [],
            "why": result.get("why") or "", "scratch": result.get("scratch") or {},
            "pieces": result.get("pieces") or {}, "kv": result.get("kv") or []}


def _after_install(kind: str) -> None:
    """What V1's capture_model does after capturing: no capture from now on, workspace locked."""
    if kind != "v1":
        return
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.v1.worker.workspace import lock_workspace

    set_cudagraph_capturing_enabled(False)
    lock_workspace()
