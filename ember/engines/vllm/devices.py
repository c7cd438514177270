"""One GPU visible to each vLLM worker of a multi-GPU LOAD, as its SAVE had.

SAVE runs one rank of the shape on one GPU, so its compiled code and graphs are for device index
0: Inductor writes the index into the code it generates (`torch.cuda._DeviceGuard(0)`,
`set_device(0)`, `get_raw_stream(0)`), and every rank runs SAVE's code (`plugin._own_rank_cache`).
vLLM's own multiprocess executor shows every worker all of the node's GPUs and puts rank r on
`cuda:r`, where SAVE's code would switch to GPU 0: rank 1 then computes on another rank's GPU and
fails, while its peers wait in a collective for ever.

So each worker of a LOAD sees only its own GPU, before anything initialises CUDA in it: its
`CUDA_VISIBLE_DEVICES` narrowed to the one entry vLLM would pick, and vLLM's logical → physical map
(`parallel_config.assigned_physical_gpu_ids`, vLLM's own mechanism for Ray-style isolation) set,
so vLLM selects the same physical GPU as index 0. NCCL reaches peers it cannot see over NVLink, as
ember's decode ranks (one GPU each) do. Where that cannot be done (CUDA already initialised, a
Ray or external launcher, a mapping the user gave), the worker is left as vLLM made it, and LOAD
refuses a rank whose device index is not SAVE's (`device_refusal`).

Also here: a thread's device made current without the allocation vLLM makes for it
(`set_device_eagerly`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from typing import Any

ENV = "CUDA_VISIBLE_DEVICES"
CUDA_ERROR_NOT_INITIALIZED = 3


def node_index(local_rank: int, pc: Any) -> int:
    """The node-local GPU vLLM 0.26 gives a worker (gpu_worker.Worker.init_device): with its own
    multiprocess executor and data parallel on one node, the data-parallel rank's block first."""
    if (pc.distributed_executor_backend in ("ray", "external_launcher") or pc.data_parallel_backend == "ray"
            or int(pc.nnodes_within_dp) != 1):
        return local_rank
    dp = pc.data_parallel_rank_local
    dp = pc.data_parallel_index if dp is None else dp
    return local_rank + int(dp) * int(pc.pipeline_parallel_size) * int(pc.tensor_parallel_size)


def visible(env: Mapping[str, str], count: Callable[[], int]) -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them (indices or UUIDs)."""
    raw = env.get(ENV)
    if raw is not None and raw.strip():
        return [e.strip() for e in raw.split(",") if e.strip()]
    return [str(i) for i in range(count())]


def driver_initialized() -> bool:  # pragma: no cover - needs the CUDA driver
    """Whether CUDA's driver is initialised in this process (then a changed CUDA_VISIBLE_DEVICES
    would change nothing): `cuDeviceGetCount` answers NOT_INITIALIZED before `cuInit`."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    n = ctypes.c_int(0)
    return int(cuda.cuDeviceGetCount(ctypes.byref(n))) != CUDA_ERROR_NOT_INITIALIZED


def one_gpu(worker: Any) -> str:
    """Before vLLM's `init_device`: this worker's GPU the only one it sees. What was done, for the
    report ("" when there was nothing to do)."""
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import _cuda_device_count_stateless

    pc = worker.parallel_config
    entries = visible(os.environ, lambda: _cuda_device_count_stateless(None))
    if len(entries) < 2:
        return ""
    if pc.distributed_executor_backend in ("ray", "external_launcher") or pc.assigned_physical_gpu_ids:
        return f"left as vLLM sets it ({pc.distributed_executor_backend}, {pc.assigned_physical_gpu_ids})"
    if driver_initialized():
        return "left as vLLM sets it: CUDA was initialised in this process before the worker's device"
    index = node_index(int(worker.local_rank), pc)
    if not 0 <= index < len(entries):
        return f"left as vLLM sets it: GPU {index} of {len(entries)}"
    physical = [int(current_platform.device_id_to_physical_device_id(i)) for i in range(len(entries))]
    os.environ[ENV] = entries[index]
    pc.assigned_physical_gpu_ids = physical
    return f"{ENV}={entries[index]} (GPU {index} of {len(entries)}, physical {physical[index]})"


def set_device_eagerly(device: Any) -> None:  # pragma: no cover - needs CUDA
    """vLLM's `CudaPlatformBase.set_device` without its one-element `torch.zeros`.

    vLLM makes a thread's device current with `torch.cuda.set_device` and then a `torch.zeros(1)`
    (torch sets the device lazily). Its multiprocess executor does that on each worker's async
    output thread, started after `load_model` while the main thread goes on allocating: a 2 MB
    segment of torch's at a point of the allocation sequence that varies from start to start, and
    that SAVE (one process, no such thread) never makes: every multi-GPU LOAD would diverge there
    (benchmarks/results/h200x2-20261130). The driver makes the device's primary context current on
    the thread instead, which is what the allocation is for, and allocates nothing."""
    import torch

    from ember.runtime.session import ensure_context

    index = torch.device(device).index
    ensure_context(torch.cuda.current_device() if index is None else int(index))


def device_refusal(saved: int, here: int) -> str:
    """Why a rank on device index `here` cannot run SAVE's compiled code ("" when it can)."""
    if saved == here:
        return ""
    return (f"SAVE's compiled code is for device index {saved} (Inductor writes it into the code) "
            f"and this worker runs on cuda:{here}: more than one GPU is visible to it")
