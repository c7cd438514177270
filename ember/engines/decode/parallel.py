"""Tensor, expert and data parallel decode: the shard shapes and the collectives.

A world is `tensor x data` ranks, one GPU each (`expert` is 1 or the whole world, as vLLM's
EP = TP x DP):
- tensor parallel (dense models): attention heads and the MLP's intermediate width are split
  column-wise into `qkv`/`gu` and row-wise into `o`/`d`; one all-reduce after each of `o` and `d`;
- expert parallel (MoE): attention is data parallel (each rank decodes its own batch with the
  whole attention); the experts are split, tokens reach them by an all-gather of the hidden
  states and come back by a reduce-scatter of the partial expert outputs;
- data parallel (dense): independent replicas, no collective in the graph.

Every rank builds the same seeded weights in the same order: replicated parameters are equal on
all ranks, and every shard of a split parameter holds the same random block (a valid shard of a
full weight made of equal blocks), so tokens agree across ranks. Collectives go through
torch.distributed on NCCL and are captured inside the graphs; at SAVE they are libember_nccl's
placeholders (`ember.runtime.comm`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ember.engines.decode.model import ModelSpec


@dataclass(frozen=True)
class Parallel:
    """The parallel shape of one rank. `collectives`: issue them even in a world of one (the
    one-GPU proof of the splice)."""

    tensor: int = 1
    expert: int = 1
    data: int = 1
    rank: int = 0
    collectives: bool = False

    @property
    def world(self) -> int:
        return self.tensor * self.data

    @property
    def experts_split(self) -> bool:
        """The MoE layer dispatches tokens across ranks (expert parallel, or forced)."""
        return self.expert > 1 or self.collectives

    @property
    def active(self) -> bool:
        """A process group: a world of several ranks, or collectives forced in a world of one."""
        return self.world > 1 or self.collectives

    @property
    def moves_data(self) -> bool:
        """Collectives in the graph (tensor or expert parallel, or forced). Data-parallel replicas
        of a dense model issue none: a one-GPU SAVE computes what every rank computes."""
        return self.tensor > 1 or self.experts_split

    def degrees(self) -> dict[str, Any]:
        """What the archive stores (the rank is the LOADing process's own)."""
        return {"tensor": self.tensor, "expert": self.expert, "data": self.data,
                "collectives": self.collectives}

    def validate(self, spec: ModelSpec) -> None:
        """Raise ValueError for a shape this model cannot be split into."""
        if min(self.tensor, self.expert, self.data) < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad parallel shape {self}")
        if self.expert not in (1, self.world):
            raise ValueError(f"expert degree must be 1 or tensor x data = {self.world}, got {self.expert}")
        if spec.experts:
            if self.tensor > 1:
                raise ValueError("MoE workloads split experts (expert parallel), not tensors: use --ep")
            if spec.experts % self.expert:
                raise ValueError(f"{spec.experts} experts do not split into {self.expert} ranks")
        elif self.expert > 1:
            raise ValueError(f"{spec.name} has no experts: expert parallel needs a MoE workload")
        for what, n in (("heads", spec.heads), ("kv_heads", spec.kv_heads), ("inter", spec.inter)):
            if n % self.tensor:
                raise ValueError(f"{what}={n} does not split into {self.tensor} tensor-parallel ranks")

    # ---- collectives (in-graph; placeholders at SAVE) ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensor > 1 or self.collectives:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def gather_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """[b, H] of this rank → [world*b, H] of all ranks (expert parallel dispatch)."""
        import torch
        import torch.distributed as dist

        out = torch.empty((self.world * h.shape[0], *h.shape[1:]), dtype=h.dtype, device=h.device)
        dist.all_gather_into_tensor(out, h.contiguous())
        return out

    def scatter_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """[world*b, H] partial sums of every rank → this rank's [b, H] totals (combine)."""
        import torch
        import torch.distributed as dist

        out = torch.empty((y.shape[0] // self.world, *y.shape[1:]), dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y.contiguous())
        return out


SINGLE = Parallel()


def init_process_group(par: Parallel, *, stub: bool) -> None:
    """torch.distributed on NCCL for this rank, with an eagerly created communicator (LOAD splices
    collectives with it before the first request). `stub`: SAVE under libember_nccl, one process
    playing rank 0 (an in-memory store: no other rank will ever join)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or not par.active:
        return
    device = torch.device("cuda", torch.cuda.current_device())
    # Every connection at init, none at a collective's first use: LOAD's splice captures a rank's
    # collectives on its own, and a capture that had to connect would wait for the peers to
    # capture the same collective (a peer that fell back to native capture never would).
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    if stub:
        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=par.rank, world_size=par.world, device_id=device)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=par.rank, world_size=par.world, device_id=device)
    # NCCL connects and loads its kernels at a communicator's first collective: done here, at
    # start (as an engine's warm-up does), not inside LOAD's first splice or a request. SAVE (a
    # placeholder) and LOAD allocate the same small tensor for it: the layouts stay equal.
    dist.barrier(device_ids=[device.index])
