"""SAVE proves its archive before publishing it: every graph, rebuilt from the SERIALIZED form,
replays bit-identically to the captured graph, through both paths LOAD may use (the group
template switched by exec update, and a dedicated exec).

The captured graph is replayed several times from the same state first: a proof against one
replay of a graph that is not bit-stable on its own would refuse (or pass) by chance. A graph
whose NATIVE replays differ cannot be proven bitwise; it is accepted only when its rebuild is
structurally identical (every node, parameter, attribute and edge with its edge data, walked
back from the driver) AND its outputs lie within the native run-to-run spread, and the report
names it (`ProofReport.nondeterministic`, kernels only those graphs use in `suspects`).

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

from ember.archive import graph_table as archive_format
from ember.archive.graphs import Graph, GraphSet, KernelRef, NodeType
from ember.engines.decode.model import DECODE_STEPS, DecodeWorkload, fingerprint
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.measures import edge_problems, spread_of, step_hashes, suspect_kernels
from ember.runtime.proof.measures import within_spread as _within

NATIVE_REPEATS = 3


class ProofFailed(RuntimeError):
    """A rebuilt graph did not replay bit-identically: the archive must not be published."""


def _philox_offset() -> int:
    state = torch.cuda.get_rng_state()  # the CUDA generator's state: seed (8 bytes), offset (8 bytes)
    return int(state[8:16].view(torch.int64).item())


def rng_consumers(graphs: dict[tuple[int, ...], Any]) -> dict[tuple[int, ...], int]:
    """The captured graphs that draw random numbers, with their Philox offset increment.

    torch's `CUDAGraph.replay()` writes the generator's seed and offset into device memory the
    graph's kernels read, then advances the offset by the graph's increment: replaying each graph
    once and watching the offset finds them. A restored graph does neither yet, so it would draw
    the same numbers on every replay; SAVE refuses such graphs (the engine captures natively).
    """
    found = {}
    for key, graph in graphs.items():
        before = _philox_offset()
        graph.replay()
        after = _philox_offset()
        if after != before:
            found[key] = after - before
    torch.cuda.synchronize()
    return found


@dataclass
class ProofReport:
    graphs: int = 0
    templates: int = 0
    template_ok: int = 0
    dedicated_ok: int = 0
    bitwise: int = 0  # graphs proven bit-identical (native replays bit-stable, rebuilt equal)
    within_spread: int = 0  # native not bit-stable: rebuilt identical in structure, outputs in spread
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nondeterministic: dict[str, dict[str, Any]] = field(default_factory=dict)
    suspects: list[str] = field(default_factory=list)  # kernels used only by non-bit-stable graphs
    programmatic_edges: int = 0  # in the captured graphs; every one rebuilt with its edge data
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

    out.extend(edge_problems(captured.edges, rebuilt.edges))
    return out


def rebuilt_edges(graph: Any) -> list[Any]:
    """(src, dst, from_port, to_port, type) of a built CUgraph, node indices in creation order."""
    from types import SimpleNamespace

    from ember.runtime.graphs.driver import graph_edges, graph_nodes

    index = {int(n): i for i, n in enumerate(graph_nodes(graph))}
    frm, to, data = graph_edges(graph)
    return [
        SimpleNamespace(
            src=index[a], dst=index[b], from_port=data[8 * j], to_port=data[8 * j + 1], type=data[8 * j + 2]
        )
        for j, (a, b) in enumerate(zip(frm, to, strict=True))
    ]


def deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Per output: 0 when bit-identical; else max |a-b| for floating outputs (inf where only one
    side is NaN) and the number of differing elements for integer/bool outputs."""
    out: list[float] = []
    for x, y in zip(a, b, strict=True):
        if x.view(torch.uint8).equal(y.view(torch.uint8)):
            out.append(0.0)
        elif x.is_floating_point():
            xd, yd = x.double(), y.double()
            d = (xd - yd).abs()
            both_nan = torch.isnan(xd) & torch.isnan(yd)
            d = torch.where(both_nan, torch.zeros_like(d), d)
            d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
            out.append(float(d.max()))
        else:
            out.append(float((x != y).sum()))
    return out


def native_spread(samples: list[list[torch.Tensor]]) -> list[float]:
    """Per output, the largest deviation between any two native replays (0 = bit-stable)."""
    pairs = [
        deviation(samples[p], samples[q]) for p in range(len(samples)) for q in range(p + 1, len(samples))
    ]
    return spread_of(pairs, len(samples[0]))


def within_spread(
    rebuilt: list[torch.Tensor], natives: list[list[torch.Tensor]], spread: list[float]
) -> tuple[bool, list[float]]:
    """proofmath.within_spread over the deviations of one rebuilt replay from each native one."""
    return _within([deviation(rebuilt, s) for s in natives], spread)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def _poison(tensors: tuple[torch.Tensor, ...]) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(0xA5)


class _Runner:
    """One graph key's replays from one saved state, outputs poisoned before each replay (a graph
    that skips writing an output cannot pass); returns copies of the outputs."""

    def __init__(self, state: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        self.state, self.outs = state, outs
        self.snap = [s.clone() for s in state]

    def restore(self) -> None:
        for s, v in zip(self.state, self.snap, strict=True):
            s.copy_(v)

    def __call__(self, launch: Callable[[], None]) -> list[torch.Tensor]:
        self.restore()
        _poison(tuple(self.outs))
        launch()
        torch.cuda.synchronize()
        return [o.clone() for o in self.outs]


def _compare(
    rebuilt: list[torch.Tensor], natives: list[list[torch.Tensor]], spread: list[float]
) -> tuple[bool, list[float]]:
    """Bitwise against the first native replay when the native graph is bit-stable; otherwise
    within the native spread (see within_spread)."""
    if not any(spread):
        return _same(rebuilt, natives[0]), deviation(rebuilt, natives[0])
    return within_spread(rebuilt, natives, spread)


def prove(
    workload: DecodeWorkload,
    graph_set: GraphSet,
    functions_of: Callable[[list[Any]], list[int]],
    *,
    dedicated: bool = True,
    repeats: int = 2,
    native_repeats: int = NATIVE_REPEATS,
) -> tuple[ProofReport, bytes, GraphLibrary]:
    """Encode → decode → rebuild → replay every graph against the captured one (same process).

    `functions_of(kernel_refs)` resolves the decoded KernelRefs to CUfunctions. Returns the
    report, the encoded graph table (what gets published) and the proven library.
    """
    rep = ProofReport(graphs=len(graph_set.graphs))
    rep.programmatic_edges = sum(e.type == 1 for g in graph_set.graphs for e in g.edges)
    t0 = time.perf_counter()
    blob = archive_format.encode(graph_set)
    rep.encode_ms = (time.perf_counter() - t0) * 1e3
    rep.table_bytes = len(blob)
    t = time.perf_counter()
    table = archive_format.decode(blob)
    table.validate()
    rep.decode_ms = (time.perf_counter() - t) * 1e3
    functions = functions_of(table.kernels)
    lib = GraphLibrary(table, functions, hot_after=0)  # the proof dedicates itself
    lib.build_templates()
    rep.templates = len(lib.groups)
    back = GraphWalker(_HandleResolver(functions, table.kernels))

    def full_structure(i: int) -> list[str]:
        rebuilt = back.walk(lib.graph(i), lib.keys[i])
        return structure_problems(graph_set.graphs[i], rebuilt, graph_set.kernels, back.kernels)

    # Structure first: every template walked back from the driver equals what was captured; the
    # edges (with edge data) of EVERY graph too (one driver call each).
    templates = {g.template for g in lib.groups}
    for i in sorted(templates):
        rep.mismatches.extend(f"graph {lib.keys[i]}: rebuilt structure: {p}" for p in full_structure(i))
    lib.prebuild_all()
    for i in range(len(lib.keys)):
        if i not in templates:
            for p in edge_problems(graph_set.graphs[i].edges, rebuilt_edges(lib.graph(i))):
                rep.mismatches.append(f"graph {lib.keys[i]}: rebuilt structure: {p}")
    state = workload.state_tensors()
    unstable: set[tuple[int, ...]] = set()
    for i, key in enumerate(lib.keys):
        run = _Runner(state, list(workload.outs[key]))
        # The captured graph, several times from the same state: is it bit-stable on its own?
        natives = [run(workload.graphs[key].replay) for _ in range(max(native_repeats, 2))]
        spread = native_spread(natives)
        stable = not any(spread)
        if not stable:
            unstable.add(tuple(key))
            problems = full_structure(i) if i not in templates else []
            rep.mismatches.extend(f"graph {key}: rebuilt structure: {p}" for p in problems)
        worst = [0.0] * len(natives[0])
        ok = True
        for _ in range(repeats):  # a race would not show every time: replay the serving path again
            good, dev = _compare(run(lambda i=i: lib.launch_template(i)), natives, spread)
            ok, worst = ok and good, [max(a, b) for a, b in zip(worst, dev, strict=True)]
        differs = "output differs from the captured graph" + (
            f" (deviation per output {worst})" if stable else f" beyond the native spread {spread}"
        )
        if ok:
            rep.template_ok += 1
        else:
            rep.mismatches.append(f"graph {key}: template path {differs}")
        good = True
        if dedicated:
            lib.dedicate(i)
            good, dev = _compare(run(lambda i=i: lib.launch(i)), natives, spread)
            worst = [max(a, b) for a, b in zip(worst, dev, strict=True)]
            lib.drop_dedicated(i)
            if not good:
                rep.mismatches.append(f"graph {key}: dedicated exec {differs} (deviation {dev})")
        rep.dedicated_ok += good
        if ok and good:
            rep.bitwise += stable
            rep.within_spread += not stable
        if not stable:
            rep.nondeterministic[",".join(map(str, key))] = {
                "native_spread": spread,
                "rebuilt_deviation": worst,
                "native_replays": len(natives),
            }
        run.restore()
    if unstable:
        rep.suspects = suspect_kernels(graph_set, unstable)
        rep.notes.append(
            f"{len(unstable)} captured graphs are not bit-stable on their own (native replays from one "
            f"state differ): {sorted(unstable)[:12]}; proven by structure + native spread, not bitwise"
        )
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


def decode_trace(
    workload: DecodeWorkload,
    launch: Callable[[tuple[int, ...]], None],
    batch: int,
    steps: int = DECODE_STEPS,
    seed: int = 11,
) -> dict[str, Any]:
    """decode_tokens plus per-step hashes: {"sha256", "steps"} (what SAVE/LOAD/bench compare)."""
    sha, _ = decode_tokens(workload, launch, batch, steps, seed)
    return {"sha256": sha, "steps": step_hashes(workload.history[:steps, :batch].cpu().numpy())}


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
