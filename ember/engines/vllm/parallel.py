"""vLLM on N ranks from one archive: its communicators, the ranks' vote, what is per rank.

vLLM 0.26 creates one `GroupCoordinator` per parallel dimension (`parallel_state.
initialize_model_parallel`: tp, dcp, pcp, pp, dp, ep, eplb, in that order, each named
`<dim>:<n>` by `_get_unique_name` and kept in `parallel_state._groups`); a group of more than one
rank gets a `CudaCommunicator` whose `pynccl_comm` is its own NCCL communicator. The collectives
inside vLLM's graphs go through those (`cuda_communicator.py`: all_reduce → pynccl once custom
all-reduce, symmetric memory and FlashInfer are off, all_gather(v), reduce_scatter(v); the EP
all2all `AgRsAll2AllManager` gathers and scatters on the dp group, or ep with sequence parallel).
So the archive's collective table names each call's group (`stub_groups` at SAVE), and each
rank's LOAD finds its own communicator of that group by name (`communicators`).

Graph content must be the same on every rank (docs/multi-gpu.md, "the rule one archive rests
on"). Two vLLM layers are not:
- `VocabParallelEmbedding` with TP > 1 masks token ids with its shard's bounds, Python ints
  (`shard_indices.org_vocab_start_index`, ...) that torch.compile bakes into the kernel: every
  restored rank would look up rank 0's shard. `patch_vocab_embedding` (SAVE, its sizing probe
  and LOAD alike, so the compiled code and the graphs are the same) reads them from a device
  buffer written when the layer is built (`BOUNDS`), at one address on every rank. The buffer
  alone proves nothing: vLLM loads an AOT-compiled forward by its config, not its code, so code
  traced without the patch (the bounds baked in) still runs. So SAVE checks the modules its
  compiled code traced (`code_refusal`) and names the patch in its facts (`COMPILED_WITH`), and
  LOAD uses no TP > 1 archive that does not (`archive_refusal`);
- `RowParallelLinear` adds its bias on TP rank 0 only (`tp_rank > 0` → no bias): a model with
  such a bias is refused (`rank_dependent`).
Experts (EP) are chosen through `expert_map`, a device tensor per rank: rank-invariant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember.archive.collectives import CommGroup
from ember.runtime.comm import Communicators, stub_comm_id

BOUNDS = "ember_vocab_bounds"  # the shard's bounds as a device buffer (see the module docstring)
COMPILED_WITH = "compiled_with"  # SAVE's facts: the patches its compiled code traced
VOCAB_PATCH = "vocab-bounds"


def device_groups() -> list[tuple[str, int, int, int]]:  # pragma: no cover - needs vLLM
    """(group name, ncclComm_t, ranks, rank in group) of every vLLM group with a communicator."""
    from vllm.distributed import parallel_state as ps

    out = []
    for name, ref in sorted(ps._groups.items()):
        group = ref()
        pynccl = getattr(getattr(group, "device_communicator", None), "pynccl_comm", None)
        if group is None or pynccl is None or getattr(pynccl, "disabled", True):
            continue
        comm = getattr(pynccl.comm, "value", pynccl.comm)  # ncclComm_t is a ctypes c_void_p
        out.append((str(name), int(comm or 0), int(group.world_size), int(group.rank_in_group)))
    return out


def communicators() -> Communicators:  # pragma: no cover - needs vLLM
    """This worker's communicators, by group name (LOAD)."""
    import torch.distributed as dist

    return Communicators(int(dist.get_world_size()), int(dist.get_rank()),
                         {name: (comm, size, rank) for name, comm, size, rank in device_groups()})


def stub_groups(stub: Any, groups: list[tuple[str, int, int, int]] | None = None) -> dict[int, CommGroup]:
    """SAVE under libember_nccl: the stub's id of each group's (fake) communicator → the group."""
    groups = device_groups() if groups is None else groups
    out = {}
    for name, comm, size, _ in groups:
        cid = stub_comm_id(stub, comm) if comm else -1
        if cid >= 0:
            out[cid] = CommGroup(name, size)
    return out


def agree(ok: bool) -> bool:  # pragma: no cover - needs vLLM
    """Every rank's verdict at once (MIN over vLLM's world CPU group, gloo); `ok` alone on one rank.
    A rank that captures natively runs warm-up steps whose collectives restored peers never issue:
    the ranks restore together or capture together."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size < 2:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=world.cpu_group)
    return bool(flag.item())


def vocab_bounds(shard: Any) -> list[int]:
    """The five bounds vLLM's `get_masked_input_and_mask` takes, from a layer's `shard_indices`."""
    return [int(shard.org_vocab_start_index), int(shard.org_vocab_end_index),
            int(shard.num_org_vocab_padding), int(shard.added_vocab_start_index),
            int(shard.added_vocab_end_index)]


def masked_input_and_mask(input_: Any, bounds: Any) -> tuple[Any, Any]:
    """vLLM's `get_masked_input_and_mask` with the bounds in a device tensor (same integers)."""
    org = (input_ >= bounds[0]) & (input_ < bounds[1])
    added = (input_ >= bounds[3]) & (input_ < bounds[4])
    added_offset = bounds[3] - (bounds[1] - bounds[0]) - bounds[2]
    valid_offset = (bounds[0] * org) + (added_offset * added)
    vocab_mask = org | added
    return vocab_mask * (input_ - valid_offset), ~vocab_mask


def patch_vocab_embedding() -> None:  # pragma: no cover - needs vLLM
    """`VocabParallelEmbedding` with its shard's bounds in device memory (TP > 1; idempotent).
    Applied before the model is built, at SAVE and at LOAD (the same compiled code)."""
    import torch
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    cls = vpe.VocabParallelEmbedding
    if getattr(cls, "_ember_bounds", False):
        return
    init, forward = cls.__init__, cls.forward

    def __init__(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        if int(getattr(self, "tp_size", 1)) > 1:
            param = next(iter(self.parameters()), None)
            device = param.device if param is not None else torch.get_default_device()
            self.register_buffer(BOUNDS, torch.tensor(vocab_bounds(self.shard_indices), dtype=torch.int64,
                                                      device=device), persistent=False)

    def patched(self: Any, input_: Any) -> Any:
        bounds = getattr(self, BOUNDS, None)
        if bounds is None:
            return forward(self, input_)
        masked_input, input_mask = masked_input_and_mask(input_, bounds)
        output_parallel = self.quant_method.embedding(self, masked_input.long())
        output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0)
        return vpe.tensor_model_parallel_all_reduce(output_parallel)

    cls.__init__, cls.forward = __init__, patched  # type: ignore[method-assign]
    cls._ember_bounds = True  # type: ignore[attr-defined]


def rank_dependent(model: Any) -> list[str]:  # pragma: no cover - needs vLLM
    """Layers of `model` whose graph content would differ per rank (one archive cannot serve)."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    out = []
    for name, m in model.named_modules():
        if int(getattr(m, "tp_size", 1)) < 2:
            continue
        if isinstance(m, RowParallelLinear) and getattr(m, "bias", None) is not None and not m.skip_bias_add:
            out.append(f"{name}: row-parallel bias (vLLM adds it on tensor rank 0 only)")
        elif isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead) \
                and getattr(m, BOUNDS, None) is None:
            out.append(f"{name}: vocabulary shard bounds as Python ints (the embedding patch is not applied)")
    return out


def traced_modules(model: Any) -> set[str] | None:
    """The Python modules the model's AOT-compiled forwards traced (vLLM's `support_torch_compile`
    keeps each as `aot_compiled_fn`; torch records its sources); None where none is compiled so."""
    found: set[str] | None = None
    for module in model.modules():
        fn = getattr(module, "aot_compiled_fn", None)
        if fn is not None:
            found = (found or set()) | {src.module for src in fn.source_info().inlined_sources}
    return found


def code_refusal(model: Any, tensor: int) -> str:
    """TP > 1: why the compiled code cannot serve every rank ('' where it can): it was traced
    without the embedding patch, so it holds this process's vocabulary bounds. Without an
    AOT-compiled forward vLLM keys its cache by the traced code itself, which the patch is in."""
    try:
        traced = traced_modules(model) if tensor > 1 else None
    except Exception as exc:  # another torch: what it traced is unknown, so is what it bakes in
        return f"cannot tell which code the compiled forward traced: {type(exc).__name__}: {exc}"
    if traced is None or __name__ in traced:
        return ""
    return ("the compiled code was traced without ember's vocabulary patch (it holds this rank's "
            "shard bounds, not every rank's)")


def archive_refusal(tensor: int, facts: Mapping[str, Any]) -> str:
    """LOAD, before anything of a TP > 1 archive is used: its SAVE must have named the patch its
    compiled code traced ('' where it did, or at TP=1)."""
    if tensor < 2 or VOCAB_PATCH in (facts.get(COMPILED_WITH) or []):
        return ""
    return ("archive's compiled code is not known to read the vocabulary bounds per rank (SAVEd "
            "before ember checked it): it would serve rank 0's shard on every rank")
