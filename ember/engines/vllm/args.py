"""An archive identity as vLLM engine arguments, the check that a vLLM config is that identity,
and the environment of a vLLM process under ember.

The operator names archives by a deployment's identity (`ModelDeploymentSpec.identity`); the SAVE
Job and every serving pod then run vLLM with `engine_args(identity)` first and the deployment's
own `engine.args` after them, so the Job captures what the pods will ask for and LOAD's sizing
check passes. `mismatches` is SAVE's guard: an archive published under an identity holds the
graphs of that identity, or nothing is published. No vLLM import here (the operator uses it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ember import settings
from ember.engines.vllm.canary import KIND as CANARY_KIND
from ember.identity import ArchiveIdentity, Parallelism

# vLLM's sleep mode: weights and KV cache through its own cuMem allocator, so that /sleep can free
# them (a warm pod of `warmPool.engine: sleeping`). Another allocation sequence: identity.
SLEEP_MODE_ARG = "--enable-sleep-mode"

# ModelDeployment capture.graphMode → vLLM's CUDAGraphMode name
GRAPH_MODES = {
    "full": "FULL",
    "piecewise": "PIECEWISE",
    "full-decode-only": "FULL_DECODE_ONLY",
    "full-and-piecewise": "FULL_AND_PIECEWISE",
}


PARALLEL_PASSES = {"fuse_allreduce_rms": False, "fuse_gemm_comms": False, "enable_sp": False}

# Inductor's deterministic mode (torch/_inductor/config.py `deterministic`), for every shape: a
# reduction's Triton config (block size and warps decide its summation order) is chosen by rule,
# not by timing the candidates at the kernel's first launch. Timed, SAVE's one GPU and a pod's
# ranks can choose differently and sum in different orders (they did: benchmarks/results/
# h200x2-20261130d), and the compiled code every rank runs is SAVE's. Combo kernels stay on, as
# vLLM turns them on (config/compilation.py), but untimed: timing a choice is an error in this mode.
NUMERICS = {"deterministic": True, "combo_kernels": True, "benchmark_combo_kernel": False}
# ...and in a vLLM identity (its `workload`: what ember runs the engine with beyond the identity's
# fields), so that an archive compiled otherwise is never found under a deployment's new identity:
# the operator SAVEs again instead of every pod refusing the stale archive. `code`: the compiled
# code reads each rank's own vocabulary bounds (ember.engines.vllm.parallel; archives SAVEd before
# SAVE checked it held rank 0's). `canary`: what LOAD's canary compares with SAVE's record (a
# LOAD refuses an archive whose canary is of another kind).
IDENTITY_WORKLOAD = {"inductor": "deterministic", "code": "rank-invariant", "canary": CANARY_KIND}

# With EMBER_VLLM_MEGA_AOT=1 (off by default, pinned off in pods: UNPROVEN in ember.settings),
# ember's vLLM processes (the Job's probe and SAVE, LOAD) store and load the compiled model as one
# AOT artifact (vllm/compilation/caching.py `reconstruct_serializable_fn_from_mega_artifact`): LOAD
# then rebuilds the piecewise backends from the compiled pieces directly, instead of unpickling the
# traced graph and running it through fake tensors to split and re-key it, most of what loading
# compiled code costs at LOAD. vLLM turns it on by default from torch 2.12; it runs on 2.10+. It is
# in vLLM's compile-cache hash, so SAVE and LOAD must agree: set, not defaulted, and named in the
# identity (`compiled`). A native start (no archive) is plain vLLM.
COMPILE_ENV = {"VLLM_USE_MEGA_AOT_ARTIFACT": "1", "VLLM_USE_STANDALONE_COMPILE": "1"}
MEGA_AOT = "EMBER_VLLM_MEGA_AOT"


def mega_aot() -> bool:
    return settings.on(MEGA_AOT)


def identity_workload() -> dict[str, str]:
    """What this process runs vLLM with beyond the identity's fields (IDENTITY_WORKLOAD, and how
    the compiled model is stored where EMBER_VLLM_MEGA_AOT=1): a standalone SAVE's or LOAD's."""
    return {**IDENTITY_WORKLOAD, **({"compiled": "mega-aot"} if mega_aot() else {})}


def _value(text: str) -> Any:
    """A compile setting as vLLM's config wants it: JSON when it parses ("3" → 3), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def several_ranks(shape: Parallelism) -> bool:
    """Whether a shape is one engine of several ranks (its archive a parallel one)."""
    return shape.tensor * shape.data * shape.expert > 1


def compilation_config(identity: ArchiveIdentity, *, rank_pins: bool | None = None,
                       deterministic: bool = True) -> dict[str, Any]:
    """`rank_pins` (default: the shape has several ranks), `deterministic`: see engine_args."""
    rank_pins = several_ranks(identity.parallelism) if rank_pins is None else rank_pins
    cfg: dict[str, Any] = {k: _value(v) for k, v in identity.compile.items()}
    cfg["cudagraph_mode"] = GRAPH_MODES.get(identity.graph_mode, identity.graph_mode.upper())
    cfg["cudagraph_capture_sizes"] = list(identity.capture_sizes)
    if deterministic:
        given = cfg.get("inductor_compile_config")
        cfg["inductor_compile_config"] = {**(given if isinstance(given, dict) else {}), **NUMERICS}
    if rank_pins:
        # Passes that keep per-rank peer state in the graph (config/compilation.py PassConfig):
        # fuse_allreduce_rms is FlashInfer's all-reduce fusion (an IPC workspace mapped from the
        # peers); fuse_gemm_comms is async TP (torch symmetric memory). Neither is an NCCL call
        # the stub can hold a place for. enable_sp (on for dense TP at -O2, config/vllm.py:258)
        # keeps only capture sizes that are multiples of TP (compilation.py:1507), which the key
        # mirror (keys.py) does not model.
        given = cfg.get("pass_config")
        cfg["pass_config"] = {**(given if isinstance(given, dict) else {}), **PARALLEL_PASSES}
    return cfg


def engine_args(identity: ArchiveIdentity, *, rank_pins: bool | None = None,
                deterministic: bool = True) -> list[str]:
    """`vllm serve` / EngineArgs command-line arguments that make vLLM capture `identity`'s graphs.
    `rank_pins` (default: the shape has several ranks): vLLM features that keep per-rank peer
    state in graphs turned off, in the one-GPU SAVE (`ember.engines.vllm.ranks`) and in every pod
    alike. The pods must run as SAVE did: the pass config is in vLLM's compile-cache hash, the
    graphs hold NCCL where vLLM would put custom all-reduce, and a rank that captures natively
    must compute what a restored one does (docs/multi-gpu.md). `deterministic` (every shape;
    False only to measure what it costs): Inductor's `NUMERICS`, so that the SAVE, every pod and
    a native capture compile the same reductions."""
    rank_pins = several_ranks(identity.parallelism) if rank_pins is None else rank_pins
    p = identity.parallelism
    args = [
        "--model", identity.model,
        "--revision", identity.revision,
        "--dtype", identity.dtype,
        "--max-num-seqs", str(identity.max_batch),
        "--max-num-batched-tokens", str(identity.max_num_tokens),
        "--compilation-config",
        json.dumps(compilation_config(identity, rank_pins=rank_pins, deterministic=deterministic),
                   sort_keys=True),
    ]
    if p.tensor > 1:
        args += ["--tensor-parallel-size", str(p.tensor)]
    if p.data > 1:
        args += ["--data-parallel-size", str(p.data)]
    if p.expert > 1:
        args += ["--enable-expert-parallel"]
    if rank_pins and p.expert > 1:
        # vLLM's default all2all (parallel.py all2all_backend) pinned: AgRsAll2AllManager is an
        # all-gather and a reduce-scatter through the device communicator (NCCL), which the stub
        # records; DeepEP/NIXL/FlashInfer backends own peer buffers it cannot stand in for
        args += ["--all2all-backend", "allgather_reducescatter"]
    if rank_pins:
        # custom all-reduce registers CUDA IPC buffers of the peers' graphs after capture
        # (custom_all_reduce.py register_graph_buffers): per-rank state no archive holds
        args += ["--disable-custom-all-reduce"]
    return args


def archived(shape: Parallelism) -> Parallelism:
    """The shape a vLLM deployment of `shape` is saved in: data parallel without expert parallel is
    data 1. vLLM 0.26 runs a dense model's DP ranks as independent engines of one replica each
    (v1/engine/core.py run_engine_core: "Non-MoE DP ranks are completely independent, so treat
    like DP=1"), so each of them restores the archive of its tensor-parallel shape, and DP=1 and
    DP=N share one SAVE. A MoE model's DP ranks without EP are one engine (its experts are tensor
    parallel across them): their engines keep DP N, and LOAD refuses the one-GPU archive for
    them (the archive's world against the engine's, `VllmAdapter.accept`): they capture natively."""
    if shape.data > 1 and shape.expert == 1:
        return Parallelism(tensor=shape.tensor, expert=1, data=1)
    return shape


def pod_args(identity: ArchiveIdentity, data: int) -> list[str]:
    """A pod's vLLM arguments for `identity` served by `data` data-parallel replicas: the
    identity's, and vLLM's DP size where the archive is one replica's (`archived`)."""
    args = engine_args(identity)
    if data > identity.parallelism.data:
        args += ["--data-parallel-size", str(data)]
    return args


def mismatches(identity: ArchiveIdentity, resolved: dict[str, Any]) -> list[str]:
    """Where the engine's resolved config (`resolved`: model, revision, dtype, engine_version,
    capture_sizes, cudagraph_mode, max_num_seqs, max_num_batched_tokens, parallelism) is not
    `identity`. (A vLLM compiling without NUMERICS is refused before this, at SAVE and at LOAD:
    `versions.unsupported_features`.)"""
    want: dict[str, Any] = {
        "model": identity.model,
        "revision": identity.revision,
        "dtype": identity.dtype,
        "engine_version": identity.engine_version,
        "capture_sizes": list(identity.capture_sizes),
        "cudagraph_mode": GRAPH_MODES.get(identity.graph_mode, identity.graph_mode.upper()),
        "max_num_seqs": identity.max_batch,
        "max_num_batched_tokens": identity.max_num_tokens,
        "parallelism": identity.parallelism.model_dump(),
    }
    out = []
    if identity.engine != "vllm":
        out.append(f"engine: identity {identity.engine!r}, this is vllm")
    for key, value in want.items():
        got = resolved.get(key)
        if key == "capture_sizes":
            got, value = sorted(got or []), sorted(value)
        if key == "engine_version" and value and str(got).startswith(f"{value}."):
            continue  # the deployment pins "0.26", vLLM says "0.26.0"
        if got != value:
            out.append(f"{key}: identity {value!r}, vLLM resolved {got!r}")
    return out


def parallelism(tensor: int, data: int, expert_parallel: bool) -> dict[str, int]:
    """A vLLM parallel config as an identity's `parallelism` (EP spans the tensor x data ranks)."""
    return {"tensor": tensor, "expert": tensor * data if expert_parallel else 1, "data": data}


# ember's per-process variables: a vLLM process never inherits them from whoever started it
PROCESS_VARS = ("LD_PRELOAD", "EMBER_MODE", "EMBER_ARM", "EMBER_VLLM_ARCHIVE", "EMBER_VLLM_STORE",
                "EMBER_VLLM_PROBE", "EMBER_VLLM_CACHES_PLACED")


EMBER_MODES = ("save", "load", "probe")  # the Job's sizing probe compiles what SAVE then loads


def process_env(mode: str, env: Mapping[str, str], *, comm_stub: bool = False) -> dict[str, str]:
    """The environment of a vLLM process: under libember in `mode` ("save" or "load"; anything
    else: vLLM as it is), with FlashInfer's sampler off (FlashInfer is not in the image). ember's
    own processes (EMBER_MODES) store the compiled model as COMPILE_ENV says where
    EMBER_VLLM_MEGA_AOT=1.
    `comm_stub`: libember_nccl answers NCCL (one process playing a rank of N), in any mode."""
    out = {k: v for k, v in env.items() if k not in PROCESS_VARS}
    if mode in ("save", "load"):
        from ember.runtime.session import preload_env

        out = preload_env(mode, out, comm_stub=comm_stub)
    elif comm_stub:
        from ember.runtime.comm import stub_path

        stub = stub_path()
        if stub is None:
            raise FileNotFoundError("libember_nccl.so not found: build libember (pip install -e .)")
        out["LD_PRELOAD"] = str(stub)
    if mode in EMBER_MODES and mega_aot():
        out.update(COMPILE_ENV)
    out.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return out
