"""SAVE proves its archive before publishing it: every graph, rebuilt from the SERIALIZED form,
replays bit-identically to the captured graph, through both paths LOAD may use (the group
template switched by exec update, and a dedicated exec).

Also the replay measurements shared by SAVE, LOAD, `ember verify --replay` and the benchmark:
output fingerprints over all keys in a fixed order, greedy decode token histories, and TPOT.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.archive import format as archive_format
from ember.archive.graphs import Graph, GraphSet, KernelRef, NodeType
from ember.runtime.library import GraphLibrary
from ember.runtime.walk import GraphWalker
from ember.runtime.workloads import DECODE_STEPS, DecodeWorkload, fingerprint

PDL_DOWNGRADED = "programmatic edges downgraded"


class ProofFailed(RuntimeError):
    """A rebuilt graph did not replay bit-identically: the archive must not be published."""


@dataclass
class ProofReport:
    graphs: int = 0
    templates: int = 0
    template_ok: int = 0
    dedicated_ok: int = 0
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    encode_ms: float = 0.0
    decode_ms: float = 0.0
    seconds: float = 0.0
    table_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.template_ok == self.graphs == self.dedicated_ok


class _HandleResolver:
    """Walks a rebuilt graph back: its function handles are the ones LOAD resolved."""

    in_process_only = True

    def __init__(self, functions: list[int], refs: list[KernelRef]) -> None:
        self._ref = dict(zip(functions, refs, strict=True))

    def lookup(self, func: int, kern: int) -> KernelRef:
        return self._ref.get(func, KernelRef("?", f"unknown function {func:#x}"))

    def function(self, ref: KernelRef) -> int:
        raise NotImplementedError


def structure_problems(
    captured: Graph, rebuilt: Graph, cap_refs: list[KernelRef], reb_refs: list[KernelRef]
) -> list[str]:
    """What differs between a captured graph and the walk of its rebuild (empty = identical).

    Edges compare as a multiset (the driver may list them in another order); everything else
    node by node."""
    out: list[str] = []
    if len(captured.nodes) != len(rebuilt.nodes):
        return [f"{len(rebuilt.nodes)} nodes rebuilt, {len(captured.nodes)} captured"]
    for i, (a, b) in enumerate(zip(captured.nodes, rebuilt.nodes, strict=True)):
        if a.type != b.type:
            out.append(f"node {i}: type {b.type.name}, captured {a.type.name}")
        elif a.type == NodeType.KERNEL:
            pa, pb = a.params, b.params
            for f in ("grid", "block", "shared_mem", "args", "arg_offsets", "arg_sizes", "extra", "attrs"):
                if getattr(pa, f) != getattr(pb, f):
                    out.append(f"node {i}: {f} differs ({cap_refs[pa.kernel].name[:60]})")
            if cap_refs[pa.kernel].name != reb_refs[pb.kernel].name:
                out.append(
                    f"node {i}: kernel {reb_refs[pb.kernel].name[:60]}, "
                    f"captured {cap_refs[pa.kernel].name[:60]}"
                )
        elif a.type != NodeType.GRAPH and a.params != b.params:
            out.append(f"node {i}: params differ")
        if len(out) > 5:
            break

    def key(e: object) -> tuple:
        return (e.src, e.dst, e.from_port, e.to_port, e.type)  # type: ignore[attr-defined]

    def as_default(e: object) -> tuple:
        return (e.src, e.dst, 0, 0, 0)  # type: ignore[attr-defined]

    cap, reb = sorted(map(key, captured.edges)), sorted(map(key, rebuilt.edges))
    if (
        cap != reb
        and sorted(map(as_default, captured.edges)) == sorted(map(as_default, rebuilt.edges))
        and not any(e.type for e in rebuilt.edges if e.type != 0 and key(e) not in set(cap))
    ):
        # Same dependencies, only edge data lost: programmatic edges became full dependencies.
        # Stricter ordering, same results (the output proof still decides); reported, not hidden.
        out.append(
            f"{PDL_DOWNGRADED}: {sum(e.type == 1 for e in captured.edges)} programmatic edges rebuilt "
            f"as default ({sum(e.type == 1 for e in rebuilt.edges)} kept)"
        )
    elif cap != reb:
        out.append(
            f"edges differ: {len(rebuilt.edges)} rebuilt vs {len(captured.edges)} captured "
            f"(programmatic {sum(e.type == 1 for e in rebuilt.edges)} vs "
            f"{sum(e.type == 1 for e in captured.edges)})"
        )
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def _poison(tensors: tuple[torch.Tensor, ...]) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(0xA5)


def prove(
    workload: DecodeWorkload,
    graph_set: GraphSet,
    functions_of: Callable[[list[Any]], list[int]],
    *,
    dedicated: bool = True,
    repeats: int = 2,
) -> tuple[ProofReport, bytes, GraphLibrary]:
    """Encode → decode → rebuild → replay every graph against the captured one (same process).

    `functions_of(kernel_refs)` resolves the decoded KernelRefs to CUfunctions. Returns the
    report, the encoded graph table (what gets published) and the proven library.
    """
    rep = ProofReport(graphs=len(graph_set.graphs))
    t0 = time.perf_counter()
    blob = archive_format.encode(graph_set)
    rep.encode_ms = (time.perf_counter() - t0) * 1e3
    rep.table_bytes = len(blob)
    t = time.perf_counter()
    table = archive_format.decode(blob)
    table.validate()
    rep.decode_ms = (time.perf_counter() - t) * 1e3
    functions = functions_of(table.kernels)
    lib = GraphLibrary(table, functions)
    lib.build_templates()
    rep.templates = len(lib.groups)
    # Structure first: every template, walked back from the driver, equals what was captured.
    back = GraphWalker(_HandleResolver(functions, table.kernels))
    for g in lib.groups:
        i = g.template
        rebuilt = back.walk(lib.graph(i), lib.keys[i])
        for p in structure_problems(graph_set.graphs[i], rebuilt, graph_set.kernels, back.kernels):
            where = rep.notes if p.startswith(PDL_DOWNGRADED) else rep.mismatches
            where.append(f"graph {lib.keys[i]}: rebuilt structure: {p}")
    lib.prebuild_all()
    state = workload.state_tensors()
    for i, key in enumerate(lib.keys):
        outs = workload.outs[key]
        snap = [s.clone() for s in state]

        def restore(snap: list[torch.Tensor] = snap) -> None:
            for s, v in zip(state, snap, strict=True):
                s.copy_(v)

        workload.graphs[key].replay()
        torch.cuda.synchronize()
        ref = [o.clone() for o in outs]
        ok = True
        for _ in range(repeats):  # a race would not show every time: replay the serving path again
            restore()
            _poison(outs)
            lib.launch_template(i)
            torch.cuda.synchronize()
            ok = ok and _same(list(outs), ref)
        if ok:
            rep.template_ok += 1
        else:
            rep.mismatches.append(f"graph {key}: template path output differs from the captured graph")
        if dedicated:
            restore()
            _poison(outs)
            lib.dedicate(i)
            lib.launch(i)
            torch.cuda.synchronize()
            if _same(list(outs), ref):
                rep.dedicated_ok += 1
            else:
                rep.mismatches.append(f"graph {key}: dedicated exec output differs from the captured graph")
            lib.drop_dedicated(i)
        else:
            rep.dedicated_ok += 1
        restore()
    rep.seconds = time.perf_counter() - t0
    return rep, blob, lib


# ---- replay measurements (same in every process) ----------------------------------------------
def replay_fingerprints(
    workload: DecodeWorkload,
    launch: Callable[[tuple[int, ...]], None],
    keys: list[tuple[int, ...]],
    outputs: Callable[[tuple[int, ...]], list[torch.Tensor]],
    seed: int = 7,
) -> dict[str, list[int]]:
    """Reset the state, replay every key once in order, fingerprint each graph's outputs."""
    workload.reset_state(seed)
    out = {}
    for key in keys:
        launch(key)
        torch.cuda.synchronize()
        out[",".join(map(str, key))] = fingerprint(outputs(key))
    return out


def decode_tokens(
    workload: DecodeWorkload,
    launch: Callable[[tuple[int, ...]], None],
    batch: int,
    steps: int = DECODE_STEPS,
    seed: int = 11,
) -> tuple[str, list[int]]:
    """Greedy decode by replay alone; returns sha256 of the token history and its first row."""
    workload.reset_state(seed)
    for _ in range(steps):
        launch((batch,))
    torch.cuda.synchronize()
    hist = workload.history[:steps, :batch].cpu()
    return hashlib.sha256(hist.numpy().tobytes()).hexdigest(), hist[:, 0].tolist()[:16]


def tpot_ms(
    workload: DecodeWorkload,
    launch: Callable[[tuple[int, ...]], None],
    batch: int,
    steps: int = 64,
    repeat: int = 3,
) -> float:
    """Mean milliseconds per decode step (graph replay), best of `repeat` runs."""
    best = float("inf")
    for _ in range(repeat):
        workload.reset_state()
        launch((batch,))  # a switch, if any, is not part of the token time
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            launch((batch,))
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / steps)
    return best
