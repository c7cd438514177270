"""Does the physical backing of the weights change a decode step's speed? One process, no libember.

The restored decode step runs 7-9 % faster than the captured one in another process, while in
ONE process a rebuilt graph runs exactly as fast as the captured one (diag_speedup.py). One thing
the LOAD process does differently: libember maps the heap up to SAVE's extent in ONE physical
piece (`premap_saved_extent`), where SAVE grows it in `EMBER_MAP_CHUNK` (256 MiB) pieces and
torch's allocator gives each large tensor its own cudaMalloc. A GPU can map a large, aligned
physical piece with large pages, so fewer TLB entries cover the weights.

This streams decode-like weights (Llama-3-8B's 14336 x 4096 fp16 projections, back to back, one
CUDA graph per pass) through GEMV (B=1) and a 64-column GEMM (B=64), with the same bytes placed
in different backings, interleaved over rounds (clocks drift), best round kept:

- `torch`: one torch.empty per matrix (what a native process's weights get);
- `vmm:<piece>`: one reserved VA range (1 GiB aligned) mapped in pieces of that size;
- `vmm:one`: the whole range in one piece (what LOAD's premap does).

    python benchmarks/results/diag/diag_backing.py --gib 16 --out result.json

H100 result: every backing within 0.7 % (benchmarks/results/diag-backing-H100-20261125.json), so
the backing is not why restored steps ran faster (benchmarks/results/tpot-explained-*.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cuda.bindings import driver as cu

from ember.runtime.graphs.driver import check

ROWS, COLS = 14336, 4096  # one MLP projection of Llama-3-8B
GIB = 1 << 30


class VmmBuffer:
    """`size` bytes of device memory at one VA range, mapped in pieces of `piece` bytes."""

    def __init__(self, size: int, piece: int, device: int = 0) -> None:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        gran = check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "granularity",
        )
        piece = min(piece, size)
        self.size = size = -(-size // piece) * piece
        assert piece % gran == 0, (piece, gran)
        self.va = check(cu.cuMemAddressReserve(size, GIB, 0, 0), "cuMemAddressReserve")
        self.pieces = 0
        for off in range(0, size, piece):
            h = check(cu.cuMemCreate(piece, prop, 0), "cuMemCreate")
            check(cu.cuMemMap(int(self.va) + off, piece, 0, h, 0), "cuMemMap")
            check(cu.cuMemRelease(h), "cuMemRelease")
            self.pieces += 1
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(cu.cuMemSetAccess(self.va, size, [acc], 1), "cuMemSetAccess")

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size // 2,), "typestr": "<f2", "data": (int(self.va), False), "version": 3}

    def free(self) -> None:
        check(cu.cuMemUnmap(self.va, self.size), "cuMemUnmap")
        check(cu.cuMemAddressFree(self.va, self.size), "cuMemAddressFree")


def matrices(backing: str, count: int) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """`count` ROWS x COLS fp16 matrices in `backing`, and how to free them."""
    if backing == "torch":
        ms = [torch.empty(ROWS, COLS, dtype=torch.float16, device="cuda") for _ in range(count)]
        return ms, ms.clear
    piece = {"one": count * ROWS * COLS * 2}.get(backing.split(":")[1]) or _size(backing.split(":")[1])
    buf = VmmBuffer(count * ROWS * COLS * 2, piece)
    flat = torch.as_tensor(buf, device="cuda")
    ms = list(flat[: count * ROWS * COLS].view(count, ROWS, COLS).unbind(0))

    def free() -> None:
        ms.clear()
        torch.cuda.synchronize()
        buf.free()

    return ms, free


def _size(text: str) -> int:
    units = {"M": 1 << 20, "G": GIB}
    return int(text[:-1]) * units[text[-1]]


def pass_ms(ms: list[torch.Tensor], batch: int, steps: int = 20) -> float:
    """Milliseconds per pass over every matrix (one captured graph per pass)."""
    x = torch.randn(COLS, batch, dtype=torch.float16, device="cuda")
    out = torch.empty(ROWS, batch, dtype=torch.float16, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for m in ms:  # warm-up outside the capture (cuBLAS picks its kernels)
            torch.matmul(m, x, out=out)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for m in ms:
            torch.matmul(m, x, out=out)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--backings", default="torch,vmm:2M,vmm:256M,vmm:512M,vmm:1G,vmm:one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    count = int(a.gib * GIB // (ROWS * COLS * 2))
    backings = a.backings.split(",")
    res: dict[str, dict[str, list[float]]] = {b: {"1": [], "64": []} for b in backings}
    for _ in range(a.rounds):
        for b in backings:
            ms, free = matrices(b, count)
            for m in ms:
                m.normal_(0, 0.02)
            for batch in (1, 64):
                res[b][str(batch)].append(pass_ms(ms, batch))
            free()
            torch.cuda.empty_cache()
    nbytes = count * ROWS * COLS * 2
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "matrices": count,
        "bytes": nbytes,
        "rounds": a.rounds,
        "pass_ms": res,
        "best_ms": {b: {k: min(v) for k, v in r.items()} for b, r in res.items()},
        "best_tb_per_s_b1": {b: nbytes / min(r["1"]) / 1e9 for b, r in res.items()},
    }
    ref = out["best_ms"]["torch"]
    out["vs_torch"] = {b: {k: v / ref[k] for k, v in r.items()} for b, r in out["best_ms"].items()}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
