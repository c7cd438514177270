"""Multi-GPU graphs from one single-GPU SAVE: collective placeholders and their splice.

SAVE runs with libember_nccl preloaded after libember (`native/src/nccl_stub.cpp`): one process
on one GPU plays rank 0 of the world, every NCCL call becomes a placeholder (a 4-byte memset of
the stub's scratch word whose value is the call's sequence number) and the stub records the
call. `placeholders()` finds those memsets in the walked graphs and writes the archive's
collective table (the manifest's engine facts, key "collectives"): each distinct collective
once, and per graph the node indices it stands at. Nothing in it is per rank: shard sizes and
buffer addresses are the same on every rank (even sharding, fixed-base layout).

LOAD on rank r: the engine has created its real communicator (as it would natively). `Splicer`
captures each distinct collective once, with that communicator, on a stream of its own, into a
tiny CUDA graph; the builder adds it as a child-graph node where the placeholder was
(`prepared.OP_SPLICE`). NCCL chooses its algorithm, protocol and channels for the real world size
and message size there, as in a native capture, so nothing NCCL-internal is patched; templates
are regrouped when two graphs of one topology group got child graphs of different shapes.
See docs/multi-gpu.md.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ember.archive.collectives import OPS, Call, Collectives
from ember.archive.graphs import GraphSet, MemsetParams, NodeType
from ember.runtime import faults
from ember.runtime.adapter import LOAD, Refused

__all__ = ["Call", "Collectives", "PlaceholderError", "Splicer", "placeholders", "stub_calls", "stub_loaded"]

STUB_NAME = "libember_nccl.so"
NCCL_SUM, NCCL_MAX = 0, 2  # ncclRedOp_t


class PlaceholderError(Exception):
    """The captured collectives cannot be restored on every rank from one archive."""


# ---- SAVE: the stub's records → the archive's table -----------------------------------------


def stub_path() -> Path | None:
    """libember_nccl.so beside libember (the same build or wheel)."""
    from ember import native

    lib = native.find_library()
    if lib is None:
        return None
    p = lib.with_name(STUB_NAME)
    return p if p.is_file() else None


def stub_loaded() -> ctypes.CDLL | None:
    """The stub, if this process runs with it preloaded (SAVE of a parallel shape)."""
    try:
        return ctypes.CDLL(STUB_NAME, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        pass
    p = stub_path()
    if p is None:
        return None
    try:
        return ctypes.CDLL(str(p), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None


def stub_calls(stub: ctypes.CDLL) -> tuple[int, dict[int, list[dict[str, Any]]]]:
    """(scratch address, calls by sequence number) as the stub recorded them."""
    import json

    stub.ember_nccl_scratch.restype = ctypes.c_ulonglong
    stub.ember_nccl_calls.restype = ctypes.c_size_t
    stub.ember_nccl_calls.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    need = stub.ember_nccl_calls(None, 0)
    buf = ctypes.create_string_buffer(need)
    stub.ember_nccl_calls(buf, need)
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for line in buf.value.decode().splitlines():
        rec = json.loads(line)
        by_seq.setdefault(int(rec["seq"]), []).append(rec)
    return int(stub.ember_nccl_scratch()), by_seq


def _check_spmd(calls: Sequence[dict[str, Any]], world: int) -> None:
    """One archive serves every rank only if the call means the same on every rank."""
    for c in calls:
        if int(c["nranks"]) != world:
            raise PlaceholderError(
                f"a {c['op']} on a communicator of {c['nranks']} ranks in a world of {world} "
                "(sub-groups are not supported yet)"
            )
        if c["op"] not in OPS:
            raise PlaceholderError(f"unknown NCCL call {c['op']!r}")
    p2p = [c for c in calls if c["op"] in ("send", "recv")]
    if p2p:
        for op in ("send", "recv"):
            peers = sorted(int(c["root"]) for c in p2p if c["op"] == op)
            if peers and peers != list(range(world)):
                raise PlaceholderError(
                    f"point-to-point {op} to peers {peers} is rank-specific; only groups that "
                    f"exchange with every rank (all-to-all) can be shared by all ranks"
                )


def placeholders(
    graph_set: GraphSet,
    scratch: int,
    by_seq: Mapping[int, list[dict[str, Any]]],
    world: int,
    nccl_version: str,
) -> Collectives | None:
    """The collective table of a walked graph set (None when no graph holds a placeholder)."""
    table: list[tuple[Call, ...]] = []
    index: dict[tuple[Call, ...], int] = {}
    nodes: dict[int, list[tuple[int, int]]] = {}
    for gi, g in enumerate(graph_set.graphs):
        for ni, node in enumerate(g.nodes):
            p = node.params
            if node.type is NodeType.GRAPH and _holds_placeholder(p, scratch):
                raise PlaceholderError(f"graph {g.key}: a collective inside a child graph (not supported)")
            if node.type is not NodeType.MEMSET or not isinstance(p, MemsetParams) or p.dst != scratch:
                continue
            calls = by_seq.get(int(p.value))
            if not calls:
                raise PlaceholderError(
                    f"graph {g.key}: node {ni}: placeholder {p.value} has no recorded call")
            _check_spmd(calls, world)
            key = tuple(Call.from_record(c) for c in calls)
            i = index.setdefault(key, len(table))
            if i == len(table):
                table.append(key)
            nodes.setdefault(gi, []).append((ni, i))
    if not nodes:
        return None
    return Collectives(world, nccl_version, table, nodes)


def _holds_placeholder(graph: Any, scratch: int) -> bool:
    for node in getattr(graph, "nodes", []):
        if node.type is NodeType.MEMSET and getattr(node.params, "dst", None) == scratch:
            return True
        if node.type is NodeType.GRAPH and _holds_placeholder(node.params, scratch):
            return True
    return False


# ---- LOAD: the rank's real collectives, captured once each -----------------------------------


def nccl_version() -> str:
    """This process's NCCL (what torch runs), "" without torch's NCCL."""
    try:
        import torch

        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        return ""


class Splicer:
    """Rank r's real collective for each placeholder, captured once, all in one libember call
    (`ember_capture_collectives`: no GIL between the captures) on first use."""

    def __init__(self, collectives: Collectives, comm: int, world: int, rank: int) -> None:
        if world != collectives.world:
            raise Refused(LOAD, f"archive saved for a world of {collectives.world}, this rank is in {world}")
        here = nccl_version()
        if collectives.nccl_version and here != collectives.nccl_version:
            raise Refused(LOAD, f"NCCL {collectives.nccl_version} at SAVE, {here or 'none'} here")
        if not comm:
            raise Refused(LOAD, "no NCCL communicator in this process")
        self.collectives, self.comm, self.world, self.rank = collectives, comm, world, rank
        self._graphs: list[int] = []
        self._shapes: list[int] = []
        self.capture_ms = 0.0  # all of this rank's collectives, one libember call

    def _capture_all(self) -> None:
        import time

        from ember.native import EmberError, Interposer

        t = time.perf_counter()
        wrong = faults.active("splice-redop")  # an injected fault: a max where the table says sum
        groups = [[(OPS.index(c.op), c.dtype, NCCL_MAX if wrong and c.redop == NCCL_SUM else c.redop,
                    c.root, c.send, c.recv, c.count) for c in calls]
                  for calls in self.collectives.table]
        try:
            self._graphs, self._shapes = Interposer.attach().capture_collectives(self.comm, groups)
        except (EmberError, OSError) as exc:
            raise Refused(LOAD, f"rank {self.rank}: its collectives could not be captured: {exc}") from exc
        self.capture_ms = (time.perf_counter() - t) * 1e3

    def graph(self, i: int) -> Any:
        """The CUgraph of collective `i` (the builder clones it into a child-graph node)."""
        if not self._graphs:
            self._capture_all()
        return self._graphs[i]

    def signature(self, i: int) -> int:
        """A hash of collective i's node types in order (what the template grouping must match)."""
        if not self._graphs:
            self._capture_all()
        return self._shapes[i]

    def close(self) -> None:
        from cuda.bindings import driver as cu

        for g in self._graphs:
            cu.cuGraphDestroy(cu.CUgraph(g))
        self._graphs, self._shapes = [], []


def torch_communicator(group: Any = None) -> int:
    """The ncclComm_t of torch's process group (`ProcessGroupNCCL._comm_ptr()`), 0 if none."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    pg = group or dist.group.WORLD
    backend = pg._get_backend(torch.device("cuda", torch.cuda.current_device()))
    get = getattr(backend, "_comm_ptr", None)
    return int(get()) if callable(get) else 0
