"""The rule one multi-GPU archive rests on: a rank's captured step is the same on every rank.

SAVE captures once, as rank 0, and every rank LOADs that archive. So what a step launches — each
op, its shapes, strides, storage offsets and scalar arguments — must not depend on the rank; only
device memory may hold per-rank values (weights, the expert ids), written outside the graph. The
EP workload broke it: `combine[:, first:first + E]` put rank 0's column offset into the kernel
arguments SAVE captured, and restored ranks other than 0 weighed rank 0's experts (wrong tokens
on both ranks, the partial sums being exchanged).

Recorded with a dispatch mode on the CPU (no GPU, no process group: the collectives stand in as
local ops of the same shapes). Needs torch; CI has none, the GPU machines run it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ember.engines.decode.model import SPECS, Layer  # noqa: E402
from ember.engines.decode.parallel import Parallel  # noqa: E402


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def describe(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return ("T", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
            if isinstance(a, list | tuple):
                return tuple(describe(x) for x in a)
            if isinstance(a, dict):
                return tuple(sorted((k, describe(v)) for k, v in a.items()))
            return a

        self.ops.append((str(func), describe(args), describe(kwargs or {})))
        return func(*args, **(kwargs or {}))


class _Local(Parallel):
    """The rank's shape with its collectives as local ops of the same shapes."""

    def all_reduce(self, x: Any) -> Any:
        return x.clone() if self.tensor > 1 else x

    def gather_tokens(self, h: Any) -> Any:
        return torch.cat([h] * self.world)

    def scatter_tokens(self, y: Any) -> Any:
        return y.view(self.world, -1, *y.shape[1:]).sum(0)


def _ops(spec: Any, rank: int, **shape: int) -> list[tuple[Any, ...]]:
    torch.manual_seed(0)
    layer = Layer(spec, 0, _Local(rank=rank, **shape)).to(torch.bfloat16)
    getattr(layer, "place_experts", lambda: None)()  # (absent in the code this test was written against)
    h = torch.randn(3, spec.hidden, dtype=torch.bfloat16)
    with torch.no_grad(), _Ops() as rec:
        layer.mlp(h)
    return rec.ops


SMALL_MOE = replace(SPECS["qwen3-moe"], hidden=64, experts=8, top_k=2, moe_inter=32, layers=1)
SMALL_DENSE = replace(SPECS["llama3-8b"], hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, layers=1)


@pytest.mark.parametrize("spec,shape", [
    (SMALL_MOE, {"data": 2, "expert": 2}),
    (SMALL_MOE, {"data": 4, "expert": 4}),
    (SMALL_DENSE, {"tensor": 2}),
    (SMALL_DENSE, {"tensor": 4}),
], ids=["ep2", "ep4", "tp2", "tp4"])
def test_every_rank_launches_what_rank_0_launches(spec: Any, shape: dict[str, int]) -> None:
    world = shape.get("tensor", 1) * shape.get("data", 1)
    first = _ops(spec, 0, **shape)
    for rank in range(1, world):
        other = _ops(spec, rank, **shape)
        diff = next((i for i, (a, b) in enumerate(zip(first, other, strict=True)) if a != b), None)
        assert diff is None, f"rank {rank} differs from rank 0 at op {diff}: {other[diff]} vs {first[diff]}"


def test_the_expert_ids_are_the_ranks_own() -> None:
    ids = [Layer(SMALL_MOE, 0, _Local(rank=r, data=2, expert=2)) for r in (0, 1)]
    for layer in ids:
        layer.place_experts()
    assert ids[0].expert_ids.tolist() == [0, 1, 2, 3] and ids[1].expert_ids.tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("spec,shape", [
    (SMALL_DENSE, {"data": 2}),
    (SMALL_MOE, {"data": 2}),
    (SMALL_DENSE, {"tensor": 2}),
    (SMALL_MOE, {"data": 2, "expert": 2}),
], ids=["dp2-dense", "dp2-moe", "tp2", "ep2"])
def test_moves_data_is_whether_a_step_issues_a_collective(
    spec: Any, shape: dict[str, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LOAD's canary compares a shape that issues no collective with SAVE's fingerprint (SAVE saw
    real data there): `moves_data` must be false exactly when a rank's layer calls none."""
    import torch.distributed as dist

    calls: list[str] = []

    def all_reduce(x: Any, *a: Any, **k: Any) -> None:
        calls.append("all_reduce")

    def all_gather(out: Any, h: Any, *a: Any, **k: Any) -> None:
        calls.append("all_gather")
        out.copy_(torch.cat([h] * (len(out) // len(h))))

    def reduce_scatter(out: Any, y: Any, *a: Any, **k: Any) -> None:
        calls.append("reduce_scatter")
        out.copy_(y[: len(out)])

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter)
    par = Parallel(rank=0, **shape)
    torch.manual_seed(0)
    layer = Layer(spec, 0, par).to(torch.bfloat16)
    getattr(layer, "place_experts", lambda: None)()
    with torch.no_grad():
        layer.mlp(torch.randn(3, spec.hidden, dtype=torch.bfloat16))
        if spec.experts == 0:
            par.all_reduce(torch.zeros(2))  # attention's output projection (tensor parallel)
    assert bool(calls) == par.moves_data, (calls, par)
