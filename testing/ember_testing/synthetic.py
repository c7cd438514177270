"""Synthetic GraphSets shaped like an LLM decode capture, for tests, the demo and the parse benchmark.

Deterministic for a seed. Every node type the archive supports appears (kernel nodes in both
argument forms with launch attributes, memset, memcpy, event record/wait, empty, a child graph),
edges carry programmatic edge data, and graphs fall into `groups` topology groups whose members
differ the way real capture sizes do (grid and argument bytes). Also fakes the kernel images
the graphs refer to. No CUDA.
"""

from __future__ import annotations

import hashlib
import random
import struct

from ember.archive.graphs import (
    Edge,
    EventParams,
    FunctionAttrs,
    Graph,
    GraphSet,
    KernelParams,
    KernelRef,
    MemcpyParams,
    MemsetParams,
    Node,
    NodeType,
)

CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PRIORITY = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY
_ATTR_VALUE = 64  # sizeof(CUlaunchAttributeValue)
_BASE = 0x7F00_0000_0000
_KERNELS = 48
_HEADER_NODES = 6  # memset, memcpy, event record, event wait, empty, child graph
_Plan = list[tuple[int, bool, dict[int, bytes]]]  # per kernel node: kernel id, gemm-like, attributes


def fake_image(n: int, size: int = 4096) -> bytes:
    """A deterministic fake ELF cubin (magic + filler)."""
    body = hashlib.sha256(f"image{n}".encode()).digest() * (size // 32)
    return b"\x7fELF" + body[: size - 4]


def image_hash(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()


def synthetic_images(count: int = 3) -> dict[str, bytes]:
    """Content hash → image bytes for the images `synthetic_graphset` refers to."""
    return {image_hash(img): img for img in (fake_image(n) for n in range(count))}


def _attr(value: bytes) -> bytes:
    return value.ljust(_ATTR_VALUE, b"\0")


def synthetic_graphset(
    graphs: int = 8, nodes: int = 120, groups: int = 2, seed: int = 0, layers: int = 32,
    child_graphs: bool = True,
) -> GraphSet:
    """`graphs` graphs keyed (1,), (2,), ... of about `nodes` nodes each in `groups` groups.

    With `child_graphs=False` the child-graph node becomes an EMPTY node (engine decode graphs
    captured from streams have no child graphs; the parse benchmark uses that shape).
    """
    rng = random.Random(seed)
    images = list(synthetic_images())
    kernels = [KernelRef(images[k % len(images)], f"_Z6kernel{k}Pfi") for k in range(_KERNELS)]
    fattrs = [
        FunctionAttrs(max_dynamic_shared=(k % 4) * 16384,
                      required_cluster=(2, 1, 1) if k % 11 == 0 else (0, 0, 0))
        for k in range(_KERNELS)
    ]
    groups = max(1, min(groups, graphs))
    body = max(1, nodes - _HEADER_NODES)
    per_layer = max(1, body // layers)
    plans = [_node_plan(rng, per_layer, layers, extra=g) for g in range(groups)]  # groups differ in size
    weights = [_BASE + 0x1_0000_0000 + i * 0x10_0000 for i in range(per_layer * layers + groups)]
    out = []
    for i in range(graphs):
        g = i * groups // graphs
        out.append(_graph(i + 1, g, plans[g], weights, child_graphs))
    return GraphSet(out, kernels, fattrs)


def _node_plan(rng: random.Random, per_layer: int, layers: int, extra: int) -> _Plan:
    """One group's fixed kernel nodes: kernel ids, argument form (gemm-like nodes pass an `extra`
    buffer) and launch attributes; every graph of the group has these nodes."""
    cluster = {CLUSTER_DIMENSION: _attr(struct.pack("<3I", 2, 1, 1))}
    prio = {PRIORITY: _attr(struct.pack("<i", 1))}
    plan: _Plan = []
    for j in range(per_layer * layers + extra):
        k = rng.randrange(_KERNELS)
        gemm = j % per_layer in (0, 2) and per_layer > 2
        plan.append((k, gemm, cluster if gemm and k % 2 == 0 else (prio if j % 97 == 0 else {})))
    return plan


def _graph(batch: int, g: int, plan: _Plan, weights: list[int], child_graphs: bool) -> Graph:
    """The graph of capture size `batch` in group `g`: header nodes, then the plan's kernels with
    the batch in their grids and arguments, chained by edges (some programmatic)."""
    act = _BASE + 0x4000_0000 + g * 0x100_0000  # activations: shared within a group
    nodes: list[Node] = [
        Node(NodeType.MEMSET, MemsetParams(act, 0, 0, 4, 256 * batch, 1)),
        Node(NodeType.MEMCPY, MemcpyParams(act + 0x1000, _BASE + 0x2000, 8 * batch)),
        Node(NodeType.EVENT_RECORD, EventParams(0)),
        Node(NodeType.WAIT_EVENT, EventParams(0)),
        Node(NodeType.EMPTY),
    ]
    child = Graph((), [
        Node(NodeType.KERNEL, KernelParams(1, (batch, 1, 1), (128, 1, 1), 0,
                                           args=struct.pack("<Qi", act, batch),
                                           arg_offsets=(0, 8), arg_sizes=(8, 4))),
        Node(NodeType.MEMSET, MemsetParams(act + 0x2000, 512, 7, 1, 64, 2 + g % 2)),
    ], [Edge(0, 1)])
    nodes.append(Node(NodeType.GRAPH, child) if child_graphs else Node(NodeType.EMPTY))
    for j, (k, gemm, attrs) in enumerate(plan):
        w = weights[j]
        if gemm:
            extra = struct.pack("<QQQi", w, act, act + 0x8000, batch).ljust(1720, b"\x11")
            p = KernelParams(k, (max(1, batch // 64), 132, 1), (384, 1, 1), 200704, extra=extra,
                             attrs=dict(attrs))
        else:
            scalar = batch if j % 3 else 4096  # some kernels do not see the batch size
            args = struct.pack("<QQQif", w, act, act + 0x8000, scalar, 1e-5)
            p = KernelParams(k, (scalar, 1, 1), (256, 1, 1), 0, args=args, arg_offsets=(0, 8, 16, 24, 28),
                             arg_sizes=(8, 8, 8, 4, 4), attrs=dict(attrs))
        nodes.append(Node(NodeType.KERNEL, p))
    n = len(nodes)
    edges = [Edge(a, a + 1, 0, 0, 1 if (a % 50 == 49) else 0) for a in range(n - 1)]
    edges.append(Edge(0, 5))  # the child graph also waits on the memset
    return Graph((batch,), nodes, edges)


def synthetic_chains(sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64), layers: int = 4,
                     seed: int = 0) -> GraphSet:
    """Decode chains shaped like an eager Llama capture on an H100, one per batch size: per layer
    norm, QKV GEMM, rope, cache write, attention (4 kernels), output GEMM, residual add, norm, up
    GEMM, activation, gate multiply, down GEMM, residual add, chained by plain edges. The sizes
    differ the way cuBLAS makes them differ: the GEMMs' cluster dimension changes with the batch
    (2 below 16, else 4; the up GEMM 1 from 32), small batches add a split-K reduction after the
    output GEMM, and a few sizes zero a workspace before the up GEMM (a memset). Every size zeroes
    the attention's workspace (a memset all share). So the graphs fall into several topology
    groups and, but for the sizes with the extra memset (a union's memsets are common to all its
    members, ember.archive.union), chain into one union."""
    rng = random.Random(seed)
    images = list(synthetic_images())
    names = ["norm", "qkv", "rope", "cache", "mask", "attn", "softmax", "pv", "oproj", "reduce", "add",
             "norm2", "up", "act", "mul", "down", "add2"]
    kernels = [KernelRef(images[k % len(images)], f"_Z{len(n)}{n}Pfi") for k, n in enumerate(names)]
    fattrs = [FunctionAttrs(max_dynamic_shared=16384 * (k % 3)) for k in range(len(names))]
    weights = [_BASE + 0x1_0000_0000 + i * 0x10_0000 for i in range(layers * len(names))]
    salt = rng.randrange(1 << 30)

    def cluster(x: int) -> dict[int, bytes]:
        return {CLUSTER_DIMENSION: _attr(struct.pack("<3I", x, 1, 1))} if x > 1 else {}

    out = []
    for b in sizes:
        act = _BASE + 0x4000_0000
        nodes: list[Node] = []
        for layer in range(layers):
            for k, name in enumerate(names):
                if name == "reduce" and b > 4:
                    continue
                if name == "attn":
                    nodes.append(Node(NodeType.MEMSET, MemsetParams(act + 0xA000, 0, 0, 4, 16 * b, 1)))
                if name == "up" and b in (24, 40, 56):
                    nodes.append(Node(NodeType.MEMSET, MemsetParams(act + 0x9000, 0, 0, 4, 64 * b, 1)))
                attrs = {}
                if name in ("qkv", "oproj", "down"):
                    attrs = cluster(2 if b < 16 else 4)
                elif name == "up":
                    attrs = cluster(1 if b >= 32 else 2)
                w = weights[layer * len(names) + k]
                args = struct.pack("<QQQii", w, act, act + 0x8000, b, salt)
                p = KernelParams(k, (max(1, b // 4), 8 if name in ("qkv", "up") else 1, 1), (128, 1, 1),
                                 fattrs[k].max_dynamic_shared, args=args, arg_offsets=(0, 8, 16, 24, 28),
                                 arg_sizes=(8, 8, 8, 4, 4), attrs=attrs)
                nodes.append(Node(NodeType.KERNEL, p))
        edges = [Edge(i, i + 1) for i in range(len(nodes) - 1)]
        out.append(Graph((b,), nodes, edges))
    return GraphSet(out, kernels, fattrs)
