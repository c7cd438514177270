"""GPU: the proof's pool check (`ember.runtime.proof.pool_check.diagnose`) on torch CUDA graphs.

A graph that reads a buffer and then advances it (`out = x + scratch; scratch += 1`) gives other
outputs on every replay from one state: the check must say memory carries it, name the buffer's
block and the node that points into it, and leave the buffer as it found it. A graph that only
reads what it is given repeats itself: the check says so."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _captured(body: Callable[[], None]) -> Any:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm up off the capture, as torch asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    return graph


def _ember_graph(*pointers: int) -> tuple[Any, Any]:
    """The graph as the proof knows it: one kernel node whose arguments are `pointers`."""
    from ember.archive.graphs import Graph, GraphSet, KernelParams, KernelRef, Node, NodeType

    args = b"".join(struct.pack("<Q", p) for p in pointers)
    node = Node(NodeType.KERNEL, KernelParams(0, (1, 1, 1), (128, 1, 1), 0, args,
                                              tuple(range(0, 8 * len(pointers), 8)), (8,) * len(pointers)))
    graph = Graph((1, 4), [node], [])
    return GraphSet([graph], [KernelRef("h", "add_kernel")], []), graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graph_that_reads_what_it_advances_is_traced_to_that_buffer() -> None:
    from ember.runtime.proof.pool_check import diagnose

    x = torch.ones(4096, device="cuda")
    scratch = torch.zeros(4096, device="cuda")
    out = torch.empty(4096, device="cuda")

    def body() -> None:
        out.copy_(x + scratch)
        scratch.add_(1)

    graph = _captured(body)
    before = scratch.clone()

    def run() -> list[Any]:
        graph.replay()
        torch.cuda.synchronize()
        return [out.clone()]

    gs, g = _ember_graph(x.data_ptr(), scratch.data_ptr(), out.data_ptr())
    note = diagnose(gs, g, run)
    assert "follow memory it does not write first" in note, note
    assert f"{scratch.data_ptr():#x}" in note and "0:add_kernel" in note, note
    assert f"{x.data_ptr():#x}" not in note, note  # read, but the same in every replay
    assert torch.equal(scratch, before)  # put back as found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graph_that_repeats_itself_is_said_to() -> None:
    from ember.runtime.proof.pool_check import diagnose

    x = torch.arange(4096, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    graph = _captured(lambda: out.copy_(x * 2))

    def run() -> list[Any]:
        graph.replay()
        torch.cuda.synchronize()
        return [out.clone()]

    gs, g = _ember_graph(x.data_ptr(), out.data_ptr())
    assert "not reproduced" in diagnose(gs, g, run)
