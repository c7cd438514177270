"""Multi-GPU graphs from one single-GPU SAVE: collective placeholders and their splice.

SAVE runs with libember_nccl preloaded after libember (`native/src/nccl_stub.cpp`): one process
on one GPU plays rank 0 of the world, every NCCL call becomes a placeholder (a 4-byte memset of
the stub's scratch word whose value is the call's sequence number) and the stub records the
call. `placeholders()` finds those memsets in the walked graphs and writes the archive's
collective table (the manifest's engine facts, key "collectives"): each distinct collective
once, and per graph the node indices it stands at. Nothing in it is per rank: shard sizes and
buffer addresses are the same on every rank (even sharding, fixed-base layout).

An engine with several communicators (vLLM: one per parallel group) tells SAVE which group each
of the stub's fake communicators belongs to (`groups`: stub id → `CommGroup`, a name and a size
every rank agrees on); the table names each call's group, never a process-local id.

LOAD on rank r: the engine has created its real communicators (as it would natively) and hands
them over as `Communicators` (the world, the rank, each group's ncclComm_t). `Splicer` maps each
group of the table to this rank's communicator of that group (a group missing, or of another
size: Refused) and captures each distinct collective once, with it, on a stream of its own, into a
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.archive.collectives import OPS, WORLD, Call, Collectives, CommGroup
from ember.archive.graphs import GraphSet, MemsetParams, NodeType
from ember.runtime import faults
from ember.runtime.adapter import LOAD, Refused

__all__ = ["Call", "Collectives", "CommGroup", "Communicators", "PlaceholderError", "Spans", "Splicer",
           "placeholders", "stub_calls", "stub_comm_id", "stub_loaded", "stub_writes"]

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


def stub_comm_id(stub: ctypes.CDLL, comm: int) -> int:
    """The stub's id of its fake communicator at address `comm` (-1: not one of the stub's)."""
    fn = stub.ember_nccl_comm_id
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return int(fn(ctypes.c_void_p(comm)))


def _check_spmd(calls: Sequence[dict[str, Any]], world: int, group: CommGroup | None = None) -> None:
    """One archive serves every rank only if the call means the same on every rank (`group`: the
    group the calls' communicator belongs to; None: the whole world's one communicator)."""
    size = world if group is None else group.nranks
    for c in calls:
        if int(c["nranks"]) != size:
            where = (f"in a world of {world} (sub-groups need the engine's group names)" if group is None
                     else f"in group {group.name} of {group.nranks}")
            raise PlaceholderError(f"a {c['op']} on a communicator of {c['nranks']} ranks {where}")
        if c["op"] not in OPS:
            raise PlaceholderError(f"unknown NCCL call {c['op']!r}")
    p2p = [c for c in calls if c["op"] in ("send", "recv")]
    if p2p:
        for op in ("send", "recv"):
            peers = sorted(int(c["root"]) for c in p2p if c["op"] == op)
            if peers and peers != list(range(size)):
                raise PlaceholderError(
                    f"point-to-point {op} to peers {peers} is rank-specific; only groups that "
                    f"exchange with every rank (all-to-all) can be shared by all ranks"
                )


class _Groups:
    """The stub's communicator ids → the table's `comms` (in order of first use)."""

    def __init__(self, world: int, groups: Mapping[int, CommGroup] | None) -> None:
        self.world, self.groups = world, groups
        self.comms: list[CommGroup] = [] if groups is not None else [CommGroup(WORLD, world)]

    def index(self, calls: Sequence[dict[str, Any]], where: str) -> int:
        """The table index of the calls' one communicator, checked (PlaceholderError)."""
        if self.groups is None:
            _check_spmd(calls, self.world)
            return 0
        ids = {int(c["comm"]) for c in calls}
        if len(ids) != 1:
            raise PlaceholderError(f"{where}: one group of NCCL calls on {len(ids)} communicators")
        group = self.groups.get(ids.pop())
        if group is None:
            raise PlaceholderError(f"{where}: a {calls[0]['op']} on a communicator of no parallel group the "
                                   "engine named (a torch process group's?)")
        _check_spmd(calls, self.world, group)
        if group not in self.comms:
            self.comms.append(group)
        return self.comms.index(group)


def placeholders(
    graph_set: GraphSet,
    scratch: int,
    by_seq: Mapping[int, list[dict[str, Any]]],
    world: int,
    nccl_version: str,
    groups: Mapping[int, CommGroup] | None = None,
) -> Collectives | None:
    """The collective table of a walked graph set (None when no graph holds a placeholder).
    `groups`: the engine's parallel group of each of the stub's communicator ids; None: every
    call is on the one communicator of the whole world (ember's decode workloads)."""
    comms = _Groups(world, groups)
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
            ci = comms.index(calls, f"graph {g.key}: node {ni}")
            key = tuple(Call.from_record(c, ci) for c in calls)
            i = index.setdefault(key, len(table))
            if i == len(table):
                table.append(key)
            nodes.setdefault(gi, []).append((ni, i))
    if not nodes:
        return None
    return Collectives(world, nccl_version, table, nodes, comms.comms)


Spans = dict[tuple[int, ...], list[tuple[int, int]]]  # per graph key: buffers, (address, bytes) each


def stub_writes(graph_set: GraphSet, collectives: Collectives | None) -> Spans:
    """Per graph key, the buffers its placeholders stand for writing. Under the stub they keep what
    the memory held, often what a later kernel of the same graph left there on the last replay:
    SAVE's proof zeroes them before every replay, or the captured graph would not even repeat
    itself (nor keep its values finite, many layers deep), and puts back what they held after."""
    if collectives is None:
        return {}
    return {tuple(graph_set.graphs[g].key): spans for g, spans in collectives.received().items()}


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


@dataclass
class Communicators:
    """This rank's real communicators: its global rank in a world of `world`, and per group name
    (`CommGroup.name`) the group's (ncclComm_t, nranks, rank in the group)."""

    world: int
    rank: int
    groups: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, given: Communicators | tuple[int, int, int]) -> Communicators:
        """From an adapter's `communicator()`: a Communicators, or the one communicator of the
        whole world as (ncclComm_t, world, rank)."""
        if isinstance(given, Communicators):
            return given
        comm, world, rank = given
        return cls(world, rank, {WORLD: (comm, world, rank)})


class Splicer:
    """Rank r's real collective for each placeholder, captured once, on first use (or `capture()`),
    in one libember call per communicator (`ember_capture_collectives`: no GIL between the
    captures)."""

    def __init__(self, collectives: Collectives, comm: Communicators | int, world: int = 0,
                 rank: int = 0) -> None:
        """`comm`: this rank's `Communicators`, or the ncclComm_t of the whole world's one
        communicator (then `world` and `rank` say where this rank is)."""
        here = Communicators.of(comm if isinstance(comm, Communicators) else (comm, world, rank))
        if here.world != collectives.world:
            raise Refused(LOAD, f"archive saved for a world of {collectives.world}, "
                                f"this rank is in {here.world}")
        version = nccl_version()
        if collectives.nccl_version and version != collectives.nccl_version:
            raise Refused(LOAD, f"NCCL {collectives.nccl_version} at SAVE, {version or 'none'} here")
        self.comms = [_communicator(g, here) for g in collectives.comms]
        self.collectives, self.world, self.rank = collectives, here.world, here.rank
        self.comm = self.comms[0] if self.comms else 0  # the one communicator of a world-only table
        self._graphs: list[int] = []
        self._shapes: list[int] = []
        self.capture_ms = 0.0  # all of this rank's collectives, one libember call per communicator

    def capture(self) -> None:
        """Capture every collective now (an engine that issues collectives of its own while
        LOAD's background thread would capture them: NCCL communicators are not for two threads
        at once). Refused when one cannot be captured."""
        if not self._graphs:
            self._capture_all()

    def _capture_all(self) -> None:
        import time

        from ember.native import EmberError, Interposer

        t = time.perf_counter()
        wrong = faults.active("splice-redop")  # an injected fault: a max where the table says sum
        graphs: list[int] = [0] * len(self.collectives.table)
        shapes: list[int] = [0] * len(self.collectives.table)
        for ci, comm in enumerate(self.comms):
            which = [i for i in range(len(self.collectives.table)) if self.collectives.comm_of(i) == ci]
            if not which:
                continue
            groups = [[(OPS.index(c.op), c.dtype, NCCL_MAX if wrong and c.redop == NCCL_SUM else c.redop,
                        c.root, c.send, c.recv, c.count) for c in self.collectives.table[i]]
                      for i in which]
            try:
                got, got_shapes = Interposer.attach().capture_collectives(comm, groups)
            except (EmberError, OSError) as exc:
                for g in graphs:
                    if g:
                        _destroy(g)
                name = self.collectives.comms[ci].name
                raise Refused(LOAD, f"rank {self.rank}: its collectives on {name} could not be "
                                    f"captured: {exc}") from exc
            for i, g, shape in zip(which, got, got_shapes, strict=True):
                graphs[i], shapes[i] = g, shape
        self._graphs, self._shapes = graphs, shapes
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
        for g in self._graphs:
            _destroy(g)
        self._graphs, self._shapes = [], []


def _communicator(group: CommGroup, here: Communicators) -> int:
    """This rank's ncclComm_t of `group` (Refused: missing, of another size, or null)."""
    mine = here.groups.get(group.name)
    if mine is None:
        have = ", ".join(f"{n} ({v[1]})" for n, v in sorted(here.groups.items())) or "none"
        raise Refused(LOAD, f"archive has collectives on group {group.name} ({group.nranks} ranks), "
                            f"this rank has no such communicator (it has: {have})")
    comm, nranks, _ = mine
    if nranks != group.nranks:
        raise Refused(LOAD, f"group {group.name} has {nranks} ranks here, {group.nranks} in the archive")
    if not comm:
        raise Refused(LOAD, f"no NCCL communicator of group {group.name} in this process")
    return int(comm)


def _destroy(graph: int) -> None:
    from cuda.bindings import driver as cu

    cu.cuGraphDestroy(cu.CUgraph(graph))


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
