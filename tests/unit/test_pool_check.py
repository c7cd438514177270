"""The proof's pool check without a GPU: which memory a graph's nodes point into, who points into a
block, and the bisection that finds the blocks whose content changes a replay's outputs."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ember.archive.graphs import (
    Graph,
    GraphSet,
    KernelParams,
    KernelRef,
    MemcpyParams,
    MemsetParams,
    Node,
    NodeType,
)
from ember.runtime.proof.pool_check import Block, culprits, pointed_blocks, pointers, readers


def _kernel(kernel: int, *args: int, struct_arg: Sequence[int] = ()) -> Node:
    """A kernel node: 8-byte arguments, a 4-byte one, then a struct holding `struct_arg`."""
    packed = b"".join(struct.pack("<Q", a) for a in args) + struct.pack("<I", 7) + b"\0" * 4
    sizes = [8] * len(args) + [4]
    if struct_arg:
        packed += b"".join(struct.pack("<Q", a) for a in struct_arg)
        sizes.append(8 * len(struct_arg))
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += max(size, 8)  # the 4-byte one is padded to 8
    return Node(NodeType.KERNEL, KernelParams(kernel, (1, 1, 1), (32, 1, 1), 0, packed, tuple(offsets),
                                              tuple(sizes)))


def _graph() -> tuple[GraphSet, Graph]:
    g = Graph((1, 8), [
        _kernel(0, 0x1000, 0x2008),  # reads A, writes into B
        Node(NodeType.MEMSET, MemsetParams(0x3000, 0, 0, 4, 16, 1)),
        _kernel(1, 0x9999_0000, struct_arg=(5, 0x2010)),  # a pointer inside a parameter struct
        Node(NodeType.MEMCPY, MemcpyParams(0x1000, 0x4000, 64)),
    ], [])
    kernels = [KernelRef("a", "gemm"), KernelRef("b", "moe_sum")]
    return GraphSet([g], kernels, []), g


BLOCKS: list[Block] = [(0x4000, 0x100), (0x1000, 0x100), (0x2000, 0x100), (0x3000, 0x10), (0x5000, 0x100)]


def test_pointers_come_from_arguments_structs_and_copies() -> None:
    _, g = _graph()
    values = {v for _, v in pointers(g)}
    assert {0x1000, 0x2008, 0x3000, 0x2010, 0x4000, 0x9999_0000} <= values
    assert 7 not in values  # a 4-byte scalar is no pointer


def test_only_the_blocks_a_node_points_into_are_taken() -> None:
    _, g = _graph()
    # 0x5000 is nobody's; 0x9999_0000 falls in no block; 0x2008 and 0x2010 are both in 0x2000's
    assert pointed_blocks(g, BLOCKS) == [(0x1000, 0x100), (0x2000, 0x100), (0x3000, 0x10), (0x4000, 0x100)]
    assert pointed_blocks(g, [(0x2FF8, 0x8)]) == []  # 0x3000 is one past that block: not in it


def test_readers_are_named_in_node_order() -> None:
    gs, g = _graph()
    assert readers(gs, g, (0x2000, 0x100)) == ["0:gemm", "2:moe_sum"]
    assert readers(gs, g, (0x1000, 0x100)) == ["0:gemm", "3:MEMCPY"]
    assert readers(gs, g, (0x5000, 0x100)) == []


def _differs(bad: set[Block], calls: list[int]) -> object:
    def differs(subset: Sequence[Block]) -> bool:
        calls.append(len(subset))
        return bool(bad & set(subset))
    return differs


def test_bisection_finds_the_block_that_carries_it() -> None:
    blocks = [(a, 16) for a in range(0, 64 * 16, 16)]
    calls: list[int] = []
    assert culprits(blocks, _differs({(37 * 16, 16)}, calls)) == [(37 * 16, 16)]  # type: ignore[arg-type]
    assert len(calls) <= 2 * 7  # two tests a level, log2(64) levels and the whole set


def test_several_blocks_each_found_and_at_most_the_limit() -> None:
    blocks = [(a, 16) for a in range(0, 32 * 16, 16)]
    bad = {(3 * 16, 16), (20 * 16, 16)}
    assert culprits(blocks, _differs(bad, [])) == sorted(bad)  # type: ignore[arg-type]
    many = {(a, 16) for a in range(0, 32 * 16, 32)}
    assert len(culprits(blocks, _differs(many, []), limit=3)) == 3  # type: ignore[arg-type]


def test_nothing_changes_nothing_found_and_blocks_that_matter_only_together() -> None:
    blocks = [(a, 16) for a in range(0, 8 * 16, 16)]
    assert culprits(blocks, lambda subset: False) == []
    together = {blocks[1], blocks[6]}  # the outputs change only when both change

    def both(subset: Sequence[Block]) -> bool:
        return together <= set(subset)

    assert culprits(blocks, both) == blocks[:4]  # the whole set, cut to the limit
