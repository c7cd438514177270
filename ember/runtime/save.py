"""SAVE, one pass, for any engine adapter: capture inside libember's capture window, walk every
graph, PROVE the archive (rebuild from the serialized form, replay, bitwise compare), then publish
it. An archive that fails any step is not published.

Runs in a process started with LD_PRELOAD=libember.so EMBER_MODE=save (armed before the model was
built: `ember.runtime.session.native_session`). What LOAD needs to skip work is recorded too: the
allocation log (the capture window's addresses come back without capturing), the kernel images
the graphs use (only those, in execution order), the RNG state, and the adapter's engine facts
(sizing hints so LOAD does not profile memory, static buffer addresses, reference results).

    adapter = SomeEngineAdapter(...)          # model built after the session was armed
    result = save(adapter, ip, store_uri)     # ProofFailed / Refused: nothing published
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.archive.graph_summary import graph_nodes
from ember.archive.graphs import GraphSet
from ember.identity import ArchiveIdentity
from ember.native import Interposer
from ember.runtime import comm, compat, publish, slim_images
from ember.runtime.adapter import ENGINE, EngineAdapter, Refused, model_config_digest
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.kernels import KernelResolver, LiveResolver, NativeResolver
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.fallbacks import prove_falling_back
from ember.runtime.proof.prove import ProofFailed, ProofReport, prove, rng_consumers
from ember.runtime.stacks import dumped_while_stuck


@dataclass
class SaveOutcome:
    """One SAVE in this process: what was captured (the native graphs, still live), proven and
    (when a store was given) published; `summary()` is what the SAVE Job reports."""

    identity: ArchiveIdentity
    graphs: int
    groups: int
    proof: ProofReport
    durations: dict[str, float] = field(default_factory=dict)
    manifest_uri: str = ""
    manifest_digest: str = ""
    bytes: int = 0
    published: bool = False
    reason: str = ""  # why nothing was published although a store was given
    archive: publish.ArchiveContent | None = None
    captured: dict[tuple[int, ...], Any] = field(default_factory=dict)  # the native graphs, still live
    graph_stats: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the engine's own figures (decode: tpot_ms)
    # `save(publish_later=True)`: publishes, with the engine's attachments as they are by then
    publish_now: Callable[[], None] | None = None

    def summary(self) -> dict[str, Any]:
        """The SAVE Job's termination-message JSON (also printed by `ember save`)."""
        return {
            "manifest_digest": self.manifest_digest,
            "bytes": self.bytes,
            "graphs": self.graphs,
            "groups": self.groups,
            "identity": self.identity.hash(),
            **proof_facts(self.proof),
            "manifest": self.manifest_uri,
            "published": self.published,
            **({"reason": self.reason} if self.reason else {}),
            "durations": {k: round(v, 4) for k, v in self.durations.items()},
            **({"graph_stats": self.graph_stats} if self.graph_stats else {}),
            "proof_slowest": self.proof.slowest,
            **self.extra,
        }


def _finite(value: Any) -> Any:
    """JSON-safe copy: non-finite floats (a NaN against a number) become strings."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def proof_facts(rep: ProofReport) -> dict[str, Any]:
    """What the proof established, for the SAVE summary and the manifest's engine facts."""
    return {
        "programmatic_edges": rep.programmatic_edges,
        "programmatic_edges_intact": rep.ok,  # the proof requires every edge's data rebuilt as captured
        "edge_strategy": rebuild.edge_strategy(),
        "bitwise_proven": rep.bitwise,
        "union_templates": rep.unions,
        "topology_groups": rep.topology_groups,
        "union_templates_dropped": rep.unions_dropped,
        "within_native_spread": rep.within_spread,
        "native_nondeterministic": _finite(rep.nondeterministic),
        "nondeterminism_suspects": rep.suspects[:20],
        "proof_notes": rep.notes[:5],
    }


def kernel_images(ip: Interposer, graph_set: GraphSet, templates: list[int]) -> list[publish.Image]:
    """The kernel images the graphs use (only those), in execution order with `templates` (in
    need order) first, with libember's load options, for LOAD's proactive loading."""
    catalog = {e["hash"]: e for e in ip.catalog()}
    per_image: dict[str, int] = {}
    for k in graph_set.kernels:
        per_image[k.image] = per_image.get(k.image, 0) + 1
    images = []
    for h in publish.execution_order(graph_set, templates):
        e = catalog.get(h, {})
        opts = {"jit": e.get("jit_options", {}), "library": e.get("library_options", {})}
        images.append(
            publish.Image(h, ip.image_bytes(h), e.get("kind", "unknown"), opts, per_image.get(h, 0))
        )
    return images


def capture(
    adapter: EngineAdapter, ip: Interposer | None, d: dict[str, float], log: Callable[[str], None]
) -> Any:
    """prepare → capture window → every key captured; refuses graphs that draw random numbers."""
    problems = adapter.check_version()
    if problems:
        raise Refused(ENGINE, f"{adapter.kind}: " + "; ".join(problems))
    t = time.perf_counter()
    adapter.prepare(None)
    d["build_s"] = time.perf_counter() - t
    if ip is not None:
        ip.capture_begin()
    t = time.perf_counter()
    try:
        graphs = adapter.capture()
        torch.cuda.synchronize()
    finally:
        if ip is not None:
            ip.capture_end()
    d["capture_s"] = time.perf_counter() - t
    log(f"Captured {len(graphs)} graphs in {d['capture_s']:.2f} s")
    t = time.perf_counter()
    random = rng_consumers(graphs)
    d["rng_check_s"] = time.perf_counter() - t  # one replay of each graph (minutes: a graph to look at)
    if random:
        key, inc = next(iter(random.items()))
        raise ProofFailed(
            f"archive NOT published: {len(random)} graphs draw random numbers (e.g. graph {key}: "
            f"Philox offset +{inc} per replay); restored graphs do not advance the generator yet, "
            "so they would repeat the same numbers on every replay. The engine captures natively."
        )
    return graphs


def walk(
    graphs: dict[tuple[int, ...], Any], keys: list[tuple[int, ...]], resolver: KernelResolver
) -> GraphSet:
    """Every captured graph in the archive's form, in the adapter's key order (the table's order:
    LOAD and the reference results replay in it, and state carries over from key to key); every
    kernel must have a catalog entry."""
    if set(keys) != set(graphs):
        odd = sorted(set(keys) ^ set(graphs))[:5]
        raise ProofFailed(f"captured graphs and the engine's keys differ, e.g. {odd}")
    walker = GraphWalker(resolver)
    graph_set = walker.graph_set([walker.walk(graphs[key].raw_cuda_graph(), key) for key in keys])
    missing = [k for k in graph_set.kernels if not k.image]
    if missing:
        raise ProofFailed(f"{len(missing)} kernels have no catalog entry, e.g. {missing[0].name}")
    return graph_set


def collective_table(adapter: EngineAdapter, graph_set: GraphSet) -> comm.Collectives | None:
    """The placeholders libember_nccl left in the graphs (a parallel shape saved on one GPU).
    A shape of several ranks must be saved under the stub: a real communicator of one rank would
    capture collectives of a world of one."""
    world = adapter.identity().parallelism
    ranks = world.tensor * world.data
    stub = comm.stub_loaded()
    if stub is None:
        if ranks > 1:
            raise Refused(ENGINE, f"a world of {ranks} ranks is saved under libember_nccl (see ember save)")
        return None
    scratch, calls = comm.stub_calls(stub)
    # an engine with several communicators names each one's group (`stub_groups`, vLLM)
    named = getattr(adapter, "stub_groups", None)
    try:
        groups = named(stub) if named is not None else None
        table = comm.placeholders(graph_set, scratch, calls, ranks, comm.nccl_version(), groups)
    except comm.PlaceholderError as exc:
        raise ProofFailed(f"archive NOT published: {exc}") from None
    if (world.tensor > 1 or world.expert > 1) and table is None:  # data parallel alone has none
        raise ProofFailed(f"archive NOT published: {world} but no collective in any graph")
    return table


def attachments(adapter: EngineAdapter) -> dict[str, bytes]:
    """Engine files shipped with the graphs (optional `attachments()`: vLLM's compile cache)."""
    attach = getattr(adapter, "attachments", None)
    return dict(attach()) if attach is not None else {}


def _log_proof(rep: ProofReport, graph_set: GraphSet, log: Callable[[str], None]) -> None:
    log(
        f"Proved {rep.graphs} graphs ({rep.templates} templates, {rep.unions} of them union templates, "
        f"{rep.programmatic_edges} programmatic "
        f"edges kept) in {rep.seconds:.2f} s: {rep.bitwise} bit-identical, {rep.within_spread} within "
        "the native run-to-run spread (captured graph not bit-stable on its own)"
    )
    if rep.suspects:
        log(f"Warning: kernels used only by the non-bit-stable graphs: {', '.join(rep.suspects[:8])}")
    if rep.slowest and rep.slowest[0]["s"] > 1.0:  # seconds for one graph: name what it launches
        log(f"Warning: the proof's slowest graphs: {rep.slowest}; the slowest one's nodes: "
            f"{graph_nodes(graph_set, tuple(rep.slowest[0]['key']))}")


def _prove_with_cut_images(
    adapter: EngineAdapter,
    graphs: Any,
    graph_set: GraphSet,
    ip: Interposer | None,
    resolver: KernelResolver,
    d: dict[str, float],
    log: Callable[[str], None],
    reset: comm.Spans | None = None,
) -> tuple[ProofReport, bytes, Any, slim_images.SlimReport | None]:
    """The proof, with the kernel images cut to what the graphs use (slim_images) where libember
    is there; should it fail, again without union templates, then with the whole images
    (proof/fallbacks.py). `reset`: `comm.stub_writes`."""
    cut = None
    if ip is not None and slim_images.enabled():
        t = time.perf_counter()
        major, minor = torch.cuda.get_device_capability()
        cut = slim_images.slim(ip, graph_set, major * 10 + minor, log)
        d["slim_s"] = time.perf_counter() - t
    subject = adapter.proof_subject(graphs)

    def run(unions: bool | None) -> tuple[ProofReport, bytes, Any]:
        return prove(subject, graph_set, resolver.function_list, resolver=resolver, unions=unions,
                     reset=reset, log=log)

    def undo() -> None:
        if cut is not None:
            slim_images.undo(graph_set, cut)

    was_cut = cut is not None and bool(cut.images)
    rep, table_blob, lib, still_cut = prove_falling_back(run, was_cut, undo, log)
    if was_cut and not still_cut:
        cut = None  # the whole images were published
    return rep, table_blob, lib, cut


def _refuse_unproven(rep: ProofReport) -> None:
    raise ProofFailed(
        "archive NOT published: "
        + "; ".join(rep.mismatches[:5])
        + "".join(f" [note: {n}]" for n in rep.notes[:2])
        + (f" [kernels only in non-bit-stable graphs: {rep.suspects[:5]}]" if rep.suspects else "")
    )


def _publish(
    out: SaveOutcome, ip: Interposer | None, store_uri: str, graph_set: GraphSet, log: Callable[[str], None]
) -> None:
    if ip is None:
        out.reason = "not published: libember is not preloaded (EMBER_MODE=save), LOAD could not find kernels"
        return
    assert out.archive is not None
    t = time.perf_counter()
    out.manifest_uri, out.manifest_digest, out.bytes = publish.write(store_uri, out.archive, graph_set)
    out.durations["publish_s"] = time.perf_counter() - t
    out.published = True
    log(f"Published {out.manifest_uri} ({out.bytes / 1e6:.1f} MB)")


def save(
    adapter: EngineAdapter,
    ip: Interposer | None,
    store_uri: str | None,
    *,
    log: Callable[[str], None] = print,
    publish_later: bool = False,
) -> SaveOutcome:
    """SAVE the adapter's engine. `store_uri=None` proves without publishing; without libember
    (`ip=None`) the graphs are proven in-process but never published (LOAD could not find their
    kernels). Raises ProofFailed or Refused; nothing is published then. `publish_later`: the
    outcome's `publish_now()` publishes, taking the attachments then (vLLM compiles Triton kernels
    in its warm-up after the graphs are captured: they ship with its compile cache)."""
    with dumped_while_stuck():
        return _save(adapter, ip, store_uri, log, publish_later)


def _publish_with_attachments(adapter: EngineAdapter, out: SaveOutcome, ip: Interposer | None, store_uri: str,
                              graph_set: GraphSet, log: Callable[[str], None]) -> None:
    out.publish_now = None  # once
    if out.archive is not None:
        out.archive.attachments = attachments(adapter)
    _publish(out, ip, store_uri, graph_set, log)


def _save(adapter: EngineAdapter, ip: Interposer | None, store_uri: str | None,
          log: Callable[[str], None], publish_later: bool = False) -> SaveOutcome:
    d: dict[str, float] = {}
    t_all = time.perf_counter()
    resolver: KernelResolver = NativeResolver(ip) if ip is not None else LiveResolver()
    graphs = capture(adapter, ip, d, log)
    t = time.perf_counter()
    graph_set = walk(graphs, adapter.keys(), resolver)
    collectives = collective_table(adapter, graph_set)
    d["walk_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rep, table_blob, lib, cut = _prove_with_cut_images(adapter, graphs, graph_set, ip, resolver, d, log,
                                                       comm.stub_writes(graph_set, collectives))
    d["prove_s"] = time.perf_counter() - t - d.get("slim_s", 0.0)
    templates = [lib.order[0], *(g.template for g in lib.groups if g.template >= 0)]  # LOAD's order
    lib.close()
    for note in rep.notes[:8]:  # a refusal's reason keeps two; the pool check adds one a graph
        log(f"Warning: {note}")
    if not rep.ok:
        _refuse_unproven(rep)
    _log_proof(rep, graph_set, log)
    t = time.perf_counter()
    facts = {
        **adapter.facts(graphs),  # reference results are computed with the NATIVE graphs here
        "graphs": len(graphs),
        "in_process_only": ip is None,
        **proof_facts(rep),
        "region": list(ip.region()) if ip is not None else None,
        **({"collectives": collectives.to_facts()} if collectives is not None else {}),
        **(cut.facts() if cut is not None else {}),
        **({"config": digest} if (digest := model_config_digest(adapter)) else {}),
    }
    d["facts_s"] = time.perf_counter() - t
    stats = {"nodes": sum(len(g.nodes) for g in graph_set.graphs), "kernels": len(graph_set.kernels)}
    out = SaveOutcome(identity=adapter.identity(), graphs=len(graphs), groups=rep.templates, proof=rep,
                      durations=d, captured=graphs, graph_stats=stats)
    out.archive = publish.ArchiveContent(
        identity=out.identity,
        compat=compat.current(adapter.engine),
        graph_table=table_blob,
        images=kernel_images(ip, graph_set, templates) if ip is not None else [],
        alloc_log=ip.export_alloc_log() if ip is not None else b"",
        rng_state=bytes(torch.cuda.get_rng_state().numpy().tobytes()),
        engine=facts,
        attachments={} if publish_later else attachments(adapter),
    )
    if store_uri is not None and publish_later:
        out.publish_now = lambda: _publish_with_attachments(adapter, out, ip, store_uri, graph_set, log)
    elif store_uri is not None:
        _publish(out, ip, store_uri, graph_set, log)
    d["total_s"] = time.perf_counter() - t_all
    return out
