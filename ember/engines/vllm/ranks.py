"""The vLLM SAVE Job as rank r of a world of N, in ONE process on ONE GPU.

A parallel identity (tensor x data ranks, expert = tensor x data or 1) is saved once on one GPU:
the Job's child runs vLLM with `--distributed-executor-backend external_launcher` (vLLM 0.26
`v1/executor/uniproc_executor.py` ExecutorWithExternalLauncher: one in-process worker whose rank
is `RANK`; `config/parallel.py` __post_init__: world_size *= data_parallel_size and
data_parallel_rank = RANK // (world_size // data_parallel_size), so DP is outermost, as `place`).
Before vLLM starts, `enter()` initializes torch.distributed itself (vLLM's
`init_distributed_environment` skips `init_process_group` when it is initialized) with torch's
in-process "fake" backend for the world and every gloo group, so no peer is ever waited for; the
GPU collectives go through vLLM's pynccl, which `enter()` points at libember_nccl (not through
`VLLM_NCCL_SO_PATH`: every VLLM_* variable is in vLLM's compile-cache hash, and the pods, which
run real NCCL, must find SAVE's compiled code), and become placeholders that each rank's LOAD
splices with its real communicator of the same group (ember.engines.vllm.parallel).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ember.engines.vllm.args import archived, parallelism, several_ranks
from ember.engines.vllm.report import REPLICAS_ENV
from ember.identity import ArchiveIdentity, Parallelism

RANK_ENV = "EMBER_VLLM_SAVE_RANK"  # the global rank the SAVE Job plays (default 0)
WORLD_ENV = "EMBER_VLLM_SAVE_WORLD"  # set by the Job in its child: one process plays a rank of N


def world(identity: ArchiveIdentity) -> int:
    p = identity.parallelism
    return p.tensor * p.data


def is_parallel(identity: ArchiveIdentity) -> bool:
    return several_ranks(identity.parallelism)


def place(rank: int, tensor: int, data: int) -> tuple[int, int]:
    """Global rank → (dp_rank, tp_rank): data parallel outermost, as vLLM numbers its world."""
    if tensor < 1 or data < 1 or not 0 <= rank < tensor * data:
        raise ValueError(f"rank {rank} is not in a world of tensor {tensor} x data {data}")
    return divmod(rank, tensor)


def save_rank(env: Mapping[str, str]) -> int:
    text = env.get(RANK_ENV, "0").strip() or "0"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{RANK_ENV}={text!r} is not a rank") from None


def refusals(identity: ArchiveIdentity, rank: int, env: Mapping[str, str] = os.environ) -> list[str]:
    """Why this Job cannot SAVE `identity` as `rank` ([] when it can)."""
    p, n = identity.parallelism, world(identity)
    out = []
    if p.expert > 1 and p.expert != n:
        out.append(f"expert {p.expert} must be tensor x data = {n} (vLLM's expert-parallel size)")
    if p.expert > 1 and p.tensor > 1 and p.data > 1:
        # vLLM 0.26 turns on sequence-parallel MoE for this shape (versions.unsupported_features)
        out.append("expert parallel with tensor > 1 and data > 1: vLLM's sequence-parallel MoE "
                   "takes each tensor rank's token chunk at a rank-dependent offset (save tensor 1)")
    if p.data > 1 and p.expert == 1:
        out.append("data parallel without expert parallel: vLLM's DP replicas of a dense model are "
                   "independent engines, saved as data 1 (ember.engines.vllm.args.archived)")
    if not 0 <= rank < n:
        out.append(f"{RANK_ENV}={rank} is not a rank of a world of {n}")
    return out


def save_args(identity: ArchiveIdentity) -> list[str]:
    """Arguments of the SAVE child only (the pods on N GPUs keep vLLM's own executor)."""
    return ["--distributed-executor-backend", "external_launcher"] if is_parallel(identity) else []


def save_env(identity: ArchiveIdentity, rank: int, stub: str) -> dict[str, str]:
    """The SAVE child's environment as `rank` of the identity's world ({} for one GPU)."""
    if not is_parallel(identity):
        return {}
    return {
        WORLD_ENV: str(world(identity)), "RANK": str(rank), "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world(identity)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29519",
        STUB_ENV: stub,  # pynccl dlsyms its own handle: LD_PRELOAD alone would not reach it (enter())
        DP_RANK_ENV: str(place(rank, identity.parallelism.tensor, identity.parallelism.data)[0]),
        **parallel_env(identity),
    }


STUB_ENV = "EMBER_VLLM_NCCL_STUB"  # the SAVE child's libember_nccl, for vLLM's pynccl (enter())
DP_RANK_ENV = "EMBER_VLLM_SAVE_DP_RANK"  # its data-parallel rank (the DP batch agreement, enter())
# vLLM settings a parallel archive is captured with, and its pods run with (ember serve adds them
# for a parallel shape's arguments, `pod_env`): see parallel_env.
PARALLEL_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
                "VLLM_USE_NCCL_SYMM_MEM": "0", "VLLM_DISTRIBUTED_USE_SPLIT_GROUP": "0",
                "NCCL_RUNTIME_CONNECT": "0"}


def parallel_env(identity: ArchiveIdentity) -> dict[str, str]:
    """vLLM settings a parallel archive is captured with (and its pods must run with).
    VLLM_ALLREDUCE_USE_SYMM_MEM=0 (vLLM's default is 1): torch symmetric-memory all-reduce
    rendezvouses buffers with the peers (`SymmMemCommunicator`, cuda_communicator.py:97), state
    the stub cannot stand in for; VLLM_ALLREDUCE_USE_FLASHINFER=0 and VLLM_USE_NCCL_SYMM_MEM=0
    (defaults, pinned against an inherited setting): FlashInfer's IPC all-reduce workspace and
    NCCL window registration are peer state too.
    VLLM_DISTRIBUTED_USE_SPLIT_GROUP=0 (vLLM's default, pinned): split_group creates sub-groups
    collectively on an eagerly connected parent (parallel_state.py:1467), not through new_group.
    The pods run with the same values: every VLLM_* variable is in the compile-cache hash
    (envs.compile_factors), and LOAD refuses a parallel shape without them (versions).
    NCCL_RUNTIME_CONNECT=0 (pods): every NCCL connection made when a communicator is created, so
    capturing the splice never waits for a peer (docs/multi-gpu.md)."""
    return dict(PARALLEL_ENV) if is_parallel(identity) else {}


def args_shape(args: list[str]) -> Parallelism:
    """The shape vLLM arguments serve (tensor and data parallel sizes, expert parallel or not)."""
    sizes = {"--tensor-parallel-size": 1, "-tp": 1, "--data-parallel-size": 1, "-dp": 1}
    expert = False
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in sizes:
            text = value if eq else (args[i + 1] if i + 1 < len(args) else "1")
            sizes[name] = int(text) if text.isdigit() and int(text) > 0 else 1
        expert = expert or name in ("--enable-expert-parallel", "-ep")
    tensor = max(sizes["--tensor-parallel-size"], sizes["-tp"])
    data = max(sizes["--data-parallel-size"], sizes["-dp"])
    return Parallelism(**parallelism(tensor, data, expert))


def parallel_args(args: list[str]) -> bool:
    """Whether vLLM arguments run an engine of several ranks whose archive is a parallel one: not
    a dense model's data-parallel replicas, each of which is an engine of its own (args.archived)."""
    return several_ranks(archived(args_shape(args)))


def pod_env(args: list[str]) -> dict[str, str]:
    """The environment a pod's vLLM gets for its arguments (ember serve --engine vllm): a parallel
    archive's settings, and the count of data-parallel replicas (`REPLICAS_ENV`)."""
    env = dict(PARALLEL_ENV) if parallel_args(args) else {}
    shape = args_shape(args)
    if shape.data > 1:
        env[REPLICAS_ENV] = str(shape.data)
    return env


def enter(env: Mapping[str, str] | None = None) -> bool:  # pragma: no cover - needs torch and vLLM
    """In the SAVE child, before vLLM: torch.distributed as `RANK` of `WORLD_SIZE` with no peers.
    False when this process is not a one-rank SAVE."""
    env = os.environ if env is None else env
    if not env.get(WORLD_ENV):
        return False
    from datetime import timedelta

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    rank, n = int(env["RANK"]), int(env[WORLD_ENV])
    # An in-process store (as ember's decode SAVE): a torch NCCL group that ever needed a peer's
    # key (vLLM's collectives go through pynccl, not torch's NCCL groups) fails in 2 min, not 30.
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=n,
                            timeout=timedelta(minutes=2))
    real_new_group = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        # vLLM's CPU groups (cpu_group, parallel_state.py:444) coordinate ranks through gloo,
        # which would connect to peers: in-process fake groups answer instead
        if kwargs.get("backend") in ("gloo", None):
            kwargs["backend"] = "fake"
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    from vllm.config.parallel import ParallelConfig

    hash_as_the_pods(ParallelConfig)
    _single_node()
    _stub_for_pynccl(env.get(STUB_ENV, ""))
    _dp_agreement_as_every_rank(int(env.get(DP_RANK_ENV, "0") or 0))
    return True


def hash_as_the_pods(config_class: Any) -> None:
    """The SAVE child's parallel config hashed as its pods' is. vLLM 0.26 multiplies `world_size`
    by the data-parallel size for `external_launcher` only (config/parallel.py __post_init__), and
    `world_size` is in `compute_hash`, which names the compile cache's directory: with DP > 1 the
    pods (vLLM's own executor, one engine per DP rank) would never find SAVE's compiled code,
    compile again and allocate otherwise (LOAD refuses then). Hashed with the pods' world size."""
    original = config_class.compute_hash
    if getattr(original, "_ember_as_pods", False):
        return

    def compute_hash(self: Any) -> Any:
        data = int(getattr(self, "data_parallel_size", 1) or 1)
        if self.distributed_executor_backend != "external_launcher" or data <= 1:
            return original(self)
        launched = self.world_size
        object.__setattr__(self, "world_size", launched // data)
        try:
            return original(self)
        finally:
            object.__setattr__(self, "world_size", launched)

    compute_hash._ember_as_pods = True  # type: ignore[attr-defined]
    config_class.compute_hash = compute_hash


class AsIfEveryRank:
    """`torch.distributed` as vLLM's DP batch agreement sees it in a one-rank SAVE
    (`v1/worker/dp_utils.py` _run_ar, `v1/worker/gpu/dp_utils.py`): each DP rank writes its column
    of a zero tensor and all-reduces it (token counts, graph mode). No peer answers here, and
    every DP rank captures the same sizes, so the agreement is "every rank asked what this one
    asked": this rank's column copied to every column. Anything else is torch.distributed's."""

    def __init__(self, dp_rank: int, real: Any) -> None:
        self.dp_rank, self.real = dp_rank, real

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        mine = tensor[..., self.dp_rank].clone()
        tensor.copy_(mine.unsqueeze(-1).expand_as(tensor))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _dp_agreement_as_every_rank(dp_rank: int) -> None:  # pragma: no cover - needs vLLM
    import torch.distributed as dist
    from vllm.v1.worker import dp_utils
    from vllm.v1.worker.gpu import dp_utils as v2_dp_utils

    for module in (dp_utils, v2_dp_utils):
        module.dist = AsIfEveryRank(dp_rank, dist)  # type: ignore[attr-defined]


def _stub_for_pynccl(stub: str) -> None:  # pragma: no cover - needs vLLM
    """vLLM's pynccl opens the library `find_nccl_library()` names: the stub here."""
    if not stub:
        return
    from vllm.distributed.device_communicators import pynccl_wrapper

    pynccl_wrapper.find_nccl_library = lambda: stub


def _single_node() -> None:  # pragma: no cover - needs vLLM
    """vLLM asks its CPU groups which ranks share a node (shared memory + object broadcasts a fake
    group cannot answer) and sets up the TP group's shared-memory broadcaster, used by
    multiprocess executors only: one node, no broadcaster."""
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import shm_broadcast

    ps.in_the_same_node_as = lambda pg, source_rank=0: [True] * _size(pg)
    ps._node_count = lambda pg: 1
    shm_broadcast.MessageQueue.create_from_process_group = staticmethod(lambda *a, **k: None)


def _size(pg: Any) -> int:  # pragma: no cover - needs torch
    import torch.distributed as dist

    return int(dist.get_world_size(pg)) if isinstance(pg, dist.ProcessGroup) else int(pg.world_size)
