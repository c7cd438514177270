"""SAVE's proof, a diagnosis (`EMBER_PROOF_POOL_CHECK=1`): why a captured graph's replays from one
state differ, and which memory carries it.

Two causes look alike from outside: a kernel that is not deterministic (atomics, a race), or a
graph that reads memory it does not write first, so what it computes follows what the last replay,
or another graph, left there. The proof restores only the graph's state, its outputs and what the
stub's collectives stand for writing; the rest of the memory its kernels point at carries over.

For one such graph: the blocks its nodes point into (the caching allocator's blocks, any pool, up
to `MAX_BLOCK` bytes each: weights and the KV cache are left out) are copied before each of two
replays (`found`, `then`). Replayed twice from `found`: different outputs mean a kernel is not
deterministic or reads memory outside those blocks (a larger one, or memory torch's allocator does
not hold: only the copied blocks are put back); equal ones mean the difference came from memory
the blocks hold, and bisecting the blocks that
differ between `found` and `then` (those put to `then`, the rest to `found`) finds the ones whose
content changes the outputs. The nodes that point into them are named in node order. Every block
is put back as it was found.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ember.archive.graphs import Graph, GraphSet, KernelParams, MemcpyParams, MemsetParams

MAX_BLOCK = 512 << 20
MAX_CULPRITS = 4
Block = tuple[int, int]  # (address, bytes)


class DeviceBytes:
    """Device bytes at an address, for torch (`torch.as_tensor` reads this interface)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


def pointers(graph: Graph) -> list[tuple[int, int]]:
    """(node index, value) of every aligned 8 bytes of each kernel argument (a pointer, or one inside
    a parameter struct) and every memset/memcpy address of the graph, child graphs included (their
    nodes under their parent's index). Values that are no pointer fall in no block."""
    out: list[tuple[int, int]] = []
    for i, node in enumerate(graph.nodes):
        p = node.params
        if isinstance(p, KernelParams):
            out += [(i, struct.unpack_from("<Q", p.args, off + k)[0])
                    for off, size in zip(p.arg_offsets, p.arg_sizes, strict=True)
                    for k in range(0, size - 7, 8) if off % 8 == 0]
        elif isinstance(p, MemsetParams):
            out.append((i, p.dst))
        elif isinstance(p, MemcpyParams):
            out += [(i, p.dst), (i, p.src)]
        elif isinstance(p, Graph):
            out += [(i, v) for _, v in pointers(p)]
    return out


def block_of(blocks: Sequence[Block], starts: Sequence[int], address: int) -> Block | None:
    """The block holding `address` (`starts`: the sorted blocks' addresses)."""
    j = bisect.bisect_right(starts, address) - 1
    if j >= 0 and address < blocks[j][0] + blocks[j][1]:
        return blocks[j]
    return None


def pointed_blocks(graph: Graph, blocks: Sequence[Block]) -> list[Block]:
    """The blocks the graph's nodes point into, each once, in address order."""
    ordered = sorted(blocks)
    starts = [b[0] for b in ordered]
    found = {b for _, v in pointers(graph) if (b := block_of(ordered, starts, v)) is not None}
    return sorted(found)


def readers(graph_set: GraphSet, graph: Graph, block: Block) -> list[str]:
    """The graph's nodes that point into `block`, in node order: `index:kernel name`."""
    lo, hi = block[0], block[0] + block[1]
    names = []
    for i, v in pointers(graph):
        if lo <= v < hi:
            node = graph.nodes[i]
            p = node.params
            name = graph_set.kernels[p.kernel].name if isinstance(p, KernelParams) else node.type.name
            if (label := f"{i}:{name}") not in names:
                names.append(label)
    return names


def culprits(blocks: Sequence[Block], differs: Callable[[Sequence[Block]], bool],
             limit: int = MAX_CULPRITS) -> list[Block]:
    """The blocks whose content alone changes the outputs (`differs(subset)`: replayed with that
    subset's content changed). Bisection; a set whose halves change nothing alone is returned
    whole (its blocks matter together); at most `limit`."""
    if limit <= 0 or not blocks or not differs(blocks):
        return []
    if len(blocks) == 1:
        return list(blocks)
    mid = len(blocks) // 2
    found = culprits(blocks[:mid], differs, limit)
    found += culprits(blocks[mid:], differs, limit - len(found))
    return found[:limit] if found else list(blocks)[:limit]


def allocator_blocks(max_block: int = MAX_BLOCK) -> list[Block]:
    """Every block of this device's caching allocator, any pool, up to `max_block` bytes."""
    import torch

    dev = torch.cuda.current_device()
    return [(int(b["address"]), int(b["size"])) for s in torch.cuda.memory_snapshot()
            if s.get("device") == dev for b in s.get("blocks", []) if 0 < int(b["size"]) <= max_block]


def diagnose(graph_set: GraphSet, graph: Graph, run: Callable[[], list[Any]]) -> str:
    """Why `run` (one replay of `graph` from its state; its outputs) does not repeat itself: a
    sentence for the proof's notes. Leaves every block it touched as it found it."""
    import torch

    blocks = pointed_blocks(graph, allocator_blocks())
    views = {b: torch.as_tensor(DeviceBytes(*b), device="cuda") for b in blocks}

    def copy() -> dict[Block, Any]:
        return {b: v.clone() for b, v in views.items()}

    def put(content: dict[Block, Any], only: Sequence[Block] = ()) -> None:
        for b in only or blocks:
            views[b].copy_(content[b])

    def same(a: list[Any], b: list[Any]) -> bool:
        return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))

    found = copy()  # what the first replay reads, and what is put back at the end
    try:
        o1 = run()
        then = copy()  # what the second one reads
        if same(o1, run()):
            return f"graph {graph.key}: two replays agreed this time (not reproduced)"
        put(found)
        r1 = run()
        put(found)
        if not same(r1, run()):
            return (f"graph {graph.key}: replays differ from the same memory: a kernel is not "
                    f"deterministic, or it reads memory outside the {len(blocks)} blocks its nodes point "
                    f"into (put back each time; blocks over {MAX_BLOCK >> 20} MB and memory torch's "
                    f"allocator does not hold are not)")
        changed = [b for b in blocks if not torch.equal(found[b], then[b])]

        def differs(subset: Sequence[Block]) -> bool:
            put(found)
            put(then, subset)
            return not same(run(), r1)

        bad = culprits(changed, differs)
        named = "; ".join(f"{b[0]:#x}+{b[1]}: {', '.join(readers(graph_set, graph, b)[:6])}" for b in bad)
        return (f"graph {graph.key}: its outputs follow memory it does not write first; of {len(changed)} "
                f"blocks two replays left different, these carry it (nodes pointing into each): "
                f"{named or 'none alone'}")
    finally:
        put(found)
        torch.cuda.synchronize()
