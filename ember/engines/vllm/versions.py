"""Which vLLM internals the adapter knows, and the check that refuses any other vLLM cleanly.

The adapter touches vLLM 0.26 at the points in `TOUCH_POINTS`. Only two are documented extension
points (the `vllm.general_plugins` entry point and `CompilationConfig`/`CacheConfig` fields); the
others are private methods and attributes, patched on the CLASS inside the engine's own process
by the plugin (no file of vLLM is edited). Each one is checked here; a missing one, another
minor version, or a feature the adapter does not handle (LoRA, speculative decoding, data/tensor/
pipeline parallelism, micro-batching, breakable graphs, Inductor graph partition, encoder graphs)
is a refusal: vLLM then starts exactly as it would without ember. Tensor and data parallel
shapes (with expert parallel) restore on N ranks from one archive (ember.engines.vllm.parallel).

How 0.27+ would differ from 0.26 (from the 0.29 and 0.33 sources read for the brief): the V2
runner becomes the default for MoE models too (0.29); `BatchExecutionDescriptor` gains fields in
0.29 and 0.33 (archive keys would need them); 0.33 adds a cuMem graph pool, breakable graphs by
default for some models, and `init_worker_extension` (a supported hook that could replace the
runner-class patches). Each is a reason to add a version here only after reading its source.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_MINOR = ("0.26",)

# (module, attribute path, documented/supported hook?, what the adapter does with it)
PARALLEL_TOUCH_POINTS: tuple[tuple[str, str, bool, str], ...] = (
    ("vllm.distributed.parallel_state", "_groups", False, "each group's communicator, by name"),
    ("vllm.distributed.parallel_state", "get_world_group", False, "the ranks' vote (its CPU group)"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding.forward", False,
     "TP: the shard's bounds read from device memory"),
    ("vllm.model_executor.layers.linear", "RowParallelLinear", False, "TP: a rank-0-only bias is refused"),
)
TOUCH_POINTS: tuple[tuple[str, str, bool, str], ...] = (
    ("vllm.plugins", "load_general_plugins", True, "runs ember's register() in every process"),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.__init__",
        False,
        "arm libember before the V1 runner allocates",
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.capture_model",
        False,
        "V1: SAVE around it / LOAD instead of it",
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.cudagraph_dispatcher",
        False,
        "V1 keys (instance attribute)",
    ),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.__init__",
        False,
        "arm libember before the V2 runner allocates",
    ),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.capture_model",
        False,
        "V2: SAVE around it / LOAD instead of it",
    ),
    (
        "vllm.v1.worker.gpu.cudagraph_utils",
        "CudaGraphManager.capture",
        False,
        "V2 FULL graphs (manager.graphs)",
    ),
    (
        "vllm.v1.worker.gpu.cudagraph_utils",
        "CudaGraphManager.dispatch",
        False,
        "V2 FULL dispatch (_graphs_captured)",
    ),
    ("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", False, "V2 FULL graph keys"),
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper.__call__", False, "capture/replay of wrapper entries"),
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper._all_instances", False, "every wrapper of the process"),
    ("vllm.compilation.cuda_graph", "CUDAGraphEntry", False, "restored entries (cudagraph, output)"),
    ("vllm.compilation.counter", "compilation_counter", False, "num_cudagraph_captured: captures counted"),
    ("vllm.compilation.monitor", "set_cudagraph_capturing_enabled", False, "V1: no capture after start-up"),
    ("vllm.v1.worker.workspace", "lock_workspace", False, "V1: what capture_model does after capturing"),
    (
        "vllm.v1.worker.gpu_worker",
        "Worker.determine_available_memory",
        False,
        "stage timing; kv_cache_memory_bytes",
    ),
    ("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model", False, "stage timing"),
    ("vllm.v1.worker.gpu_worker", "Worker.load_model", False, "stage timing"),
    ("vllm.v1.worker.gpu_worker", "Worker.initialize_from_config", False, "stage timing"),
    ("vllm.forward_context", "BatchDescriptor", False, "wrapper entry keys"),
    ("vllm.platforms.cuda", "CudaPlatformBase.set_device", False,
     "a thread's device made current without an allocation"),
)

# BatchDescriptor / BatchExecutionDescriptor fields the archive keys encode (0.26).
BATCH_DESCRIPTOR_FIELDS = ("num_tokens", "num_reqs", "uniform", "has_lora", "num_active_loras")
EXECUTION_DESCRIPTOR_FIELDS = ("cg_mode", "num_tokens", "num_reqs", "uniform_token_count", "num_active_loras")


def check_version_string(version: str) -> list[str]:
    """[] when `version` is a vLLM release the adapter knows."""
    parts = version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return [f"vLLM version {version!r} is not a release version"]
    if ".".join(parts[:2]) not in SUPPORTED_MINOR:
        return [f"vLLM {version} is not supported (adapter knows {', '.join(SUPPORTED_MINOR)}.x)"]
    return []


def _resolve(module: str, path: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_touch_points() -> list[str]:
    """Touch points that do not exist in the imported vLLM."""
    import dataclasses

    problems = []
    for module, path, _, _ in TOUCH_POINTS + PARALLEL_TOUCH_POINTS:
        try:
            _resolve(module, path.removesuffix(".cudagraph_dispatcher"))
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{path} is missing ({type(exc).__name__})")
    for module, cls, fields in (
        ("vllm.forward_context", "BatchDescriptor", BATCH_DESCRIPTOR_FIELDS),
        ("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", EXECUTION_DESCRIPTOR_FIELDS),
    ):
        try:
            have = tuple(f.name for f in dataclasses.fields(_resolve(module, cls)))
        except (ImportError, AttributeError, TypeError):
            continue  # reported above
        if have != fields:
            problems.append(f"{cls} fields are {have}, the adapter knows {fields}")
    return problems


def engine_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return ""


def check_engine() -> list[str]:
    """Why this process's vLLM is not one the adapter knows ([] when it is)."""
    version = engine_version()
    if not version:
        return ["vLLM is not importable"]
    return check_version_string(version) or missing_touch_points()


def _parallel(pc: Any) -> bool:
    ranks = int(getattr(pc, "tensor_parallel_size", 1) or 1) * int(getattr(pc, "data_parallel_size", 1) or 1)
    return ranks > 1


def _parallel_pins(pc: Any) -> list[str]:
    """A parallel shape runs as its archive was saved: peer features off (ember.engines.vllm.args
    engine_args and ranks.PARALLEL_ENV; every VLLM_* variable is in vLLM's compile-cache hash)."""
    import os

    from ember.engines.vllm.ranks import PARALLEL_ENV

    out = []
    if not getattr(pc, "disable_custom_all_reduce", False):
        out.append("custom all-reduce on a parallel shape "
                   "(--disable-custom-all-reduce, as engine_args passes)")
    for name, value in PARALLEL_ENV.items():
        if name.startswith("VLLM_") and os.environ.get(name, "") != value:
            out.append(f"{name}={os.environ.get(name, '(unset)')} on a parallel shape ({value} expected)")
    return out


def unsupported_features(vllm_config: Any) -> list[str]:
    """Configurations whose graphs the adapter does not know how to key or restore (0.26)."""
    out = []
    pc, cc = vllm_config.parallel_config, vllm_config.compilation_config
    if getattr(vllm_config, "lora_config", None) is not None:
        out.append("LoRA (graphs per active-LoRA count)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        out.append("speculative decoding (drafter graphs)")
    # tensor and data parallel restore on N ranks (ember.engines.vllm.parallel); pipeline stages
    # send activations point to point, to one peer: rank-specific, refused
    if int(getattr(pc, "pipeline_parallel_size", 1) or 1) != 1:
        out.append(f"pipeline_parallel_size={pc.pipeline_parallel_size} (point-to-point sends to one peer)")
    if _parallel(pc):
        out += _parallel_pins(pc)
    if getattr(pc, "use_sequence_parallel_moe", False):
        # vLLM 0.26 config/parallel.py use_sequence_parallel_moe (all2all allgather_reducescatter,
        # EP, TP > 1 and DP > 1): MoE layers take the TP rank's token chunk, `torch.narrow(x, 0,
        # tp_rank * chunk, chunk)` (model_executor/models/utils.py sequence_parallel_chunk_impl),
        # a rank-dependent offset the graphs would hold as rank 0's
        out.append("sequence-parallel MoE (expert parallel with tensor > 1 and data > 1: each TP "
                   "rank's token chunk is a view offset by its rank)")
    if getattr(pc, "use_ubatching", False) or getattr(pc, "enable_dbo", False):
        out.append("micro-batching (DBO)")
    if getattr(cc, "use_inductor_graph_partition", False):
        out.append("Inductor graph partition (graphs inside Inductor)")
    inductor = int(getattr(cc, "mode", 0) or 0) > 0 and getattr(cc, "backend", "") in ("", "inductor")
    if inductor and not (getattr(cc, "inductor_compile_config", None) or {}).get("deterministic"):
        # ember.engines.vllm.args.NUMERICS: SAVE compiles with it, and a pod compiling otherwise
        # times its reductions' configs and may sum in another order than the archive's kernels
        out.append("Inductor without its deterministic mode (inductor_compile_config.deterministic; "
                   "ember's engine arguments set it)")
    try:
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        if is_breakable_cudagraph_enabled():
            out.append("breakable CUDA graphs")
    except ImportError:
        pass
    if getattr(vllm_config.model_config, "enforce_eager", False):
        out.append("enforce_eager (no graphs)")
    return out
