"""SAVE proves its archive before publishing it: every graph, rebuilt from the SERIALIZED form,
replays bit-identically to the captured graph, through both paths LOAD may use (the group
template switched by exec update, and a dedicated exec).

The captured graph is replayed several times from the same state first: a proof against one
replay of a graph that is not bit-stable on its own would refuse (or pass) by chance. A graph
whose NATIVE replays differ cannot be proven bitwise; it is accepted only when its rebuild is
structurally identical (every node, parameter, attribute and edge with its edge data, walked
back from the driver) AND its outputs lie within the native run-to-run spread, and the report
names it (`ProofReport.nondeterministic`, kernels only those graphs use in `suspects`).

The proof knows no engine: what it replays and compares is a `ProofSubject` (an engine adapter's
`proof_subject()`, see ember.runtime.adapter). The torch-free half of the comparison is
`measures`; the replay measurements every process shares (fingerprints, decode traces, TPOT)
are `replay`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ember import settings
from ember.archive import graph_table
from ember.archive.graphs import Graph, GraphSet, KernelRef
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.graphs.walk import GraphWalker, KernelUnnamed, WalkRefused
from ember.runtime.proof.measures import spread_of, suspect_kernels
from ember.runtime.proof.measures import within_spread as _within
from ember.runtime.proof.pool_check import DeviceBytes, diagnose
from ember.runtime.proof.profile import top_kernels
from ember.runtime.proof.structure import structure_problems
from ember.runtime.verify import first_difference

NATIVE_REPEATS = 3
SECOND_LOOK = 8  # native replays more before a rebuilt graph that differs is refused
SLOW_KEY_S = 5.0
GraphKey = tuple[int, ...]


class ProofSubject(Protocol):
    """What SAVE's proof replays and compares, for any engine: the captured graphs (the
    reference), each graph's outputs (compared bitwise), and the state every replay starts from."""

    @property
    def graphs(self) -> Mapping[GraphKey, Any]:
        """The captured graphs by key, each with `replay()` (torch.cuda.CUDAGraph)."""
        ...

    @property
    def outs(self) -> Mapping[GraphKey, Sequence[torch.Tensor]]:
        """The tensors each graph writes, compared after every replay."""
        ...

    def state_tensors(self) -> Sequence[torch.Tensor]:
        """Tensors the graphs read and update (saved once, restored before every replay)."""
        ...


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
    unions: int = 0  # union templates among them (ember.archive.union)
    topology_groups: int = 0  # the templates there would be without unions
    unions_dropped: str = ""  # why SAVE proved again without union templates (their proof failed)
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
    # the keys whose proof took longest (key, seconds, bytes snapshotted and poisoned per replay):
    # a SAVE that runs for minutes names the graph it spent them on
    slowest: list[dict[str, Any]] = field(default_factory=list)

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

    def function_list(self, refs: list[KernelRef]) -> list[int]:
        raise NotImplementedError


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
    """measures.within_spread over the deviations of one rebuilt replay from each native one."""
    return _within([deviation(rebuilt, s) for s in natives], spread)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def _poison(tensors: tuple[torch.Tensor, ...]) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(0xA5)


class _Runner:
    """One graph key's replays from one saved state, outputs poisoned before each replay (a graph
    that skips writing an output cannot pass); returns copies of the outputs. `reset`: buffers
    (address, bytes) zeroed first, before the state: what SAVE's stub collectives would write
    (they move no data, so a replay would read what the last one left there). `finish` puts
    back what they held, in case one is not the graph's own scratch."""

    def __init__(self, state: Sequence[torch.Tensor], outs: list[torch.Tensor],
                 reset: Sequence[tuple[int, int]] = ()) -> None:
        self.state, self.outs = state, outs
        self.snap = [s.clone() for s in state]
        self.zeros = [torch.as_tensor(DeviceBytes(a, n), device="cuda") for a, n in reset]
        self.held = [z.clone() for z in self.zeros]

    def restore(self) -> None:
        for z in self.zeros:
            z.zero_()
        for s, v in zip(self.state, self.snap, strict=True):
            s.copy_(v)

    def finish(self) -> None:
        """Everything this key's replays touched as they found it (outputs aside)."""
        self.restore()
        for z, v in zip(self.zeros, self.held, strict=True):
            z.copy_(v)

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
    subject: ProofSubject,
    graph_set: GraphSet,
    functions_of: Callable[[list[Any]], list[int]],
    *,
    dedicated: bool = True,
    repeats: int = 2,
    native_repeats: int = NATIVE_REPEATS,
    resolver: Any = None,
    unions: bool | None = None,
    reset: Mapping[GraphKey, Sequence[tuple[int, int]]] | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[ProofReport, bytes, GraphLibrary]:
    """Encode → decode → rebuild → replay every graph against the captured one (same process).

    `functions_of(kernel_refs)` resolves the decoded KernelRefs to CUfunctions; `resolver` (a
    KernelResolver, SAVE's) names the rebuilt graphs' kernels again from their handles for the
    structure check (without one, the table's refs name them). `unions`: whether the table holds
    union templates (default: `graph_table.unions_by_default()`); their members are proven
    through them. `reset`: per key, buffers zeroed before each replay (`_Runner`). `log` hears
    of keys slower than SLOW_KEY_S. Returns the report, the encoded graph table (what gets
    published) and the proven library. Steps: `_encode_decode`, `_StructureCheck`, `_prove_key`
    per key, `_note_unstable`.
    """
    rep = ProofReport(graphs=len(graph_set.graphs))
    rep.programmatic_edges = sum(e.type == 1 for g in graph_set.graphs for e in g.edges)
    t0 = time.perf_counter()
    blob, table = _encode_decode(graph_set, rep, unions)
    lib = _rebuild_checked(graph_set, table, functions_of, resolver, rep)
    state, resets = subject.state_tensors(), reset or {}
    # optional: a subject whose graphs each read their own tensors (vLLM's piecewise graphs)
    # gives them per key, so each key snapshots only what it reads
    state_for = getattr(subject, "state_for", None)

    def runner(key: GraphKey) -> _Runner:
        return _Runner(state_for(key) if state_for is not None else state, list(subject.outs[key]),
                       resets.get(tuple(key), ()))

    unstable: set[GraphKey] = set()
    for i, key in enumerate(lib.keys):
        t = time.perf_counter()
        run = runner(key)
        stable = _prove_key(
            rep, lib, run, i, subject.graphs[key].replay,
            dedicated=dedicated, repeats=repeats, native_repeats=native_repeats,
        )
        if not stable:
            unstable.add(tuple(key))
        run.finish()
        _note_time(rep, key, time.perf_counter() - t, run, log, f"{i + 1} of {len(lib.keys)}")
    _profile_slowest(rep, subject, runner)
    _note_unstable(rep, graph_set, unstable)
    if unstable and settings.on("EMBER_PROOF_POOL_CHECK"):
        _pool_check(rep, graph_set, subject, runner, unstable, log)
    rep.seconds = time.perf_counter() - t0
    return rep, blob, lib


def _rebuild_checked(graph_set: GraphSet, table: graph_table.GraphTable,
                     functions_of: Callable[[list[Any]], list[int]], resolver: Any, rep: ProofReport
                     ) -> GraphLibrary:
    """The decoded table rebuilt as LOAD would (templates, unions), every graph's structure
    checked against the captured one (`_StructureCheck`, into `rep`)."""
    functions = functions_of(table.kernels)
    lib = GraphLibrary(table, functions, hot_after=0)  # the proof dedicates itself
    lib.build_templates()
    rep.templates = len(lib.groups)
    rep.unions = sum(g.union is not None for g in lib.groups)
    rep.topology_groups = len(table.groups)
    structure = _StructureCheck(graph_set, lib, functions, table.kernels, resolver)
    rep.mismatches.extend(structure.check_all())
    rep.notes.extend(structure.notes[:3])
    return lib


def _note_time(rep: ProofReport, key: GraphKey, seconds: float, run: _Runner,
               log: Callable[[str], None] | None, where: str, keep: int = 3) -> None:
    def nbytes(ts: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    rep.slowest.append({"key": list(key), "s": round(seconds, 4),
                        "state_bytes": nbytes(run.state), "out_bytes": nbytes(run.outs)})
    rep.slowest.sort(key=lambda x: -x["s"])
    del rep.slowest[keep:]
    if log is not None and seconds > SLOW_KEY_S:  # a SAVE killed later still names the graph
        log(f"[ember] the proof took {seconds:.1f} s on graph {key} ({where})")


def _profile_slowest(rep: ProofReport, subject: ProofSubject, runner: Callable[[GraphKey], _Runner]) -> None:
    """The slowest graph's kernels by GPU time (`proof.profile`), when its proof took longer than
    EMBER_PROOF_PROFILE_S: replayed once more from its state, which is put back after."""
    limit = settings.number("EMBER_PROOF_PROFILE_S")
    if not rep.slowest or limit <= 0 or rep.slowest[0]["s"] <= limit:
        return
    key = next((k for k in subject.graphs if list(k) == rep.slowest[0]["key"]), None)
    if key is None:
        return
    run = runner(key)
    run.restore()
    rep.slowest[0]["kernels"] = top_kernels(subject.graphs[key].replay)
    run.finish()


def _encode_decode(graph_set: GraphSet, rep: ProofReport, unions: bool | None = None
                   ) -> tuple[bytes, graph_table.GraphTable]:
    """The graph table as it will be published, and decoded again as LOAD reads it."""
    t = time.perf_counter()
    blob = graph_table.encode(graph_set, unions=unions)
    rep.encode_ms = (time.perf_counter() - t) * 1e3
    rep.table_bytes = len(blob)
    t = time.perf_counter()
    table = graph_table.decode(blob)
    table.validate()
    rep.decode_ms = (time.perf_counter() - t) * 1e3
    return blob, table


class _StructureCheck:
    """Every rebuilt graph walked back from the driver, in full, against the captured one.

    The rebuilt walk names its kernels through `resolver` (SAVE's own: libember's catalog by
    image hash + name, found again from the rebuilt node's function handle) and reads each
    function's attributes from the driver, so a kernel resolved to a same-named function of
    another image, or one whose attributes LOAD did not apply, is a difference. Without a
    resolver (or where it cannot name a handle LOAD resolved) the table's refs name the handles."""

    def __init__(self, graph_set: GraphSet, lib: GraphLibrary, functions: list[int], refs: list[KernelRef],
                 resolver: Any = None) -> None:
        self.graph_set, self.lib = graph_set, lib
        self._fallback = GraphWalker(_HandleResolver(functions, refs))
        self.walker = GraphWalker(resolver) if resolver is not None else self._fallback
        self.notes: list[str] = []

    def _walk(self, i: int, graph: Any = None) -> tuple[Graph, GraphWalker]:
        """This graph (or `graph`, a union template) walked by the resolver; only where it cannot
        name a kernel, this graph (and no other) is named by the table's refs. Any other refusal
        is the graph's problem."""
        key = self.lib.keys[i] if graph is None else ()
        graph = self.lib.graph(i) if graph is None else graph
        if self.walker is not self._fallback:
            try:
                return self.walker.walk(graph, key), self.walker
            except KernelUnnamed as exc:
                self.notes.append(f"rebuilt graph {key}: named by the table's refs ({exc.reason})")
        return self._fallback.walk(graph, key), self._fallback

    def _problems(self, i: int) -> list[str]:
        try:
            rebuilt, w = self._walk(i)
        except WalkRefused as exc:
            return [f"graph {self.lib.keys[i]}: rebuilt graph not walkable: {exc.reason}"]
        gs = self.graph_set
        found = structure_problems(
            gs.graphs[i], rebuilt, gs.kernels, w.kernels, gs.function_attrs, w.function_attrs
        )
        return [f"graph {self.lib.keys[i]}: rebuilt structure: {p}" for p in found]

    def check_all(self) -> list[str]:
        """Every graph in full: nodes, parameters, kernels by image + name, function attributes,
        child graphs, event pattern, edges with their edge data. Builds every graph's CUgraph."""
        self.lib.prebuild_all()
        out: list[str] = []
        for i in range(len(self.lib.keys)):
            out.extend(self._problems(i))
        for g in self.lib.groups:  # a union template, walked back like the graphs
            if g.union is not None:
                out.extend(self._union_problems(g.union))
        return out

    def _union_problems(self, union: Any) -> list[str]:
        where = f"union template of {len(union.members)} graphs"
        try:
            rebuilt, w = self._walk(-1, union.graph)
        except WalkRefused as exc:
            return [f"{where}: not walkable: {exc.reason}"]
        gs, expected = self.graph_set, self.lib.source.graph_of_row(union.info.row)  # type: ignore[attr-defined]
        found = structure_problems(expected, rebuilt, gs.kernels, w.kernels, gs.function_attrs,
                                   w.function_attrs)
        return [f"{where}: rebuilt structure: {p}" for p in found]


def _prove_key(
    rep: ProofReport,
    lib: GraphLibrary,
    run: _Runner,
    i: int,
    replay: Callable[[], None],
    *,
    dedicated: bool,
    repeats: int,
    native_repeats: int,
) -> bool:
    """Graph i: the captured graph replayed several times from the same state (is it bit-stable
    on its own?), then the rebuilt one through its group template (`repeats` times: a race would
    not show every time) and through a dedicated exec, each compared with it. Before a rebuilt
    replay that differs refuses, native gets a second look (SECOND_LOOK replays more): a native
    difference its first replays missed makes a spread, judged as any graph's whose native replays
    differ (h200-20261201b: a MoE piece whose bf16 subnormals differ in some replays only). Records
    the outcome in `rep`; returns whether the captured graph is bit-stable."""
    key = lib.keys[i]
    natives = [run(replay) for _ in range(max(native_repeats, 2))]
    templates = [run(lambda: lib.launch_template(i)) for _ in range(repeats)]
    owns: list[list[torch.Tensor]] = []
    if dedicated:
        lib.own.instantiate(i)
        owns.append(run(lambda: lib.launch(i)))
        lib.own.drop(i)
    spread = native_spread(natives)
    (ok, worst, where), (good, dev, _) = _judge(natives, spread, templates), _judge(natives, spread, owns)
    if not (ok and good):
        natives += [run(replay) for _ in range(SECOND_LOOK)]
        spread = native_spread(natives)
        (ok, worst, where), (good, dev, _) = _judge(natives, spread, templates), _judge(natives, spread, owns)
    stable = not any(spread)
    differs = "output differs from the captured graph" + (
        f" (deviation per output {worst}{'; ' + where if where else ''})" if stable
        else f" beyond the native spread {spread}"
    )
    rep.template_ok += ok
    if not ok:
        rep.mismatches.append(f"graph {key}: template path {differs}")
    rep.dedicated_ok += good
    if not good:
        rep.mismatches.append(f"graph {key}: dedicated exec {differs} (deviation {dev})")
    if ok and good:
        rep.bitwise += stable
        rep.within_spread += not stable
    if not stable:
        rep.nondeterministic[",".join(map(str, key))] = {
            "native_spread": spread,
            "rebuilt_deviation": [max(a, b) for a, b in zip(worst, dev, strict=True)],
            "native_replays": len(natives),
        }
    return stable


def _judge(natives: list[list[torch.Tensor]], spread: list[float],
           rebuilt: list[list[torch.Tensor]]) -> tuple[bool, list[float], str]:
    """Rebuilt replays against the native ones and their spread (`_compare`): all good?, the
    largest deviation per output, where the first that is not good differs ('' when all are)."""
    ok, worst, where = True, [0.0] * len(natives[0]), ""
    for got in rebuilt:
        good, dev = _compare(got, natives, spread)
        ok, worst = ok and good, [max(a, b) for a, b in zip(worst, dev, strict=True)]
        where = where or ("" if good else first_difference(natives[0], got))
    return ok, worst, where


def _pool_check(rep: ProofReport, graph_set: GraphSet, subject: ProofSubject,
                runner: Callable[[GraphKey], _Runner], unstable: set[GraphKey],
                log: Callable[[str], None] | None, most: int = 4) -> None:
    """A diagnosis (`EMBER_PROOF_POOL_CHECK`): for the first few graphs whose native replays
    differ, whether memory outside their state carries it, and which (`pool_check`), in the notes
    and, as each is found, the log (a SAVE cut later still has them)."""
    graphs = {tuple(g.key): g for g in graph_set.graphs}
    for key in sorted(unstable)[:most]:
        run = runner(key)
        try:
            replay = functools.partial(run, subject.graphs[key].replay)
            rep.notes.append(diagnose(graph_set, graphs[key], replay))
        except Exception as exc:  # a diagnosis never fails the proof
            rep.notes.append(f"graph {key}: pool check failed: {type(exc).__name__}: {exc}")
        finally:
            run.finish()
        if log is not None:
            log(f"[ember] pool check: {rep.notes[-1]}")


def _note_unstable(rep: ProofReport, graph_set: GraphSet, unstable: set[GraphKey]) -> None:
    """Name the graphs proven by structure + native spread instead of bitwise, and the kernels
    only they use."""
    if unstable:
        rep.suspects = suspect_kernels(graph_set, unstable)
        rep.notes.append(
            f"{len(unstable)} captured graphs are not bit-stable on their own (native replays from one "
            f"state differ): {sorted(unstable)[:12]}; proven by structure + native spread, not bitwise"
        )
