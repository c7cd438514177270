"""SAVE, one pass: build the workload, capture inside the native capture window, walk every
graph, PROVE the archive (rebuild from the serialized form, replay, bitwise compare), then
publish it through the store. An archive that fails any step is not published.

Runs in a process started with LD_PRELOAD=libember.so EMBER_MODE=save (`ember save` re-execs
itself that way). What LOAD needs to skip work is recorded too: the allocation log (so the
capture window's addresses come back without capturing), the kernel images the graphs use (only
those, in execution order), the KV-cache size (no memory profiling at LOAD), the RNG state,
the static buffers' addresses and the graph outputs' layouts, plus reference fingerprints of
every graph's outputs and of greedy decode histories that `ember verify --replay` and the
benchmark check in other processes.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ember
from ember.archive.graphs import GraphSet
from ember.engines.decode.model import DecodeWorkload
from ember.identity import ArchiveIdentity
from ember.runtime import compat, publish
from ember.runtime.graphs import rebuild
from ember.runtime.graphs.kernels import KernelResolver, LiveResolver, NativeResolver
from ember.runtime.graphs.walk import GraphWalker
from ember.runtime.proof.prove import (
    ProofFailed,
    ProofReport,
    decode_trace,
    prove,
    replay_fingerprints,
    rng_consumers,
    tpot_ms,
)
from ember.runtime.session import native_session

ENGINE = "ember-decode"
DECODE_CHECK_BATCHES = (1, 8, 64)


@dataclass
class SaveOutcome:
    identity: ArchiveIdentity
    graphs: int
    groups: int
    proof: ProofReport
    durations: dict[str, float] = field(default_factory=dict)
    manifest_uri: str = ""
    manifest_digest: str = ""
    bytes: int = 0
    published: bool = False
    archive: publish.Archive | None = None
    tpot_ms: dict[str, float] = field(default_factory=dict)  # captured graphs, under libember

    def summary(self) -> dict[str, Any]:
        """The SAVE Job's termination-message JSON."""
        return {
            "manifest_digest": self.manifest_digest,
            "bytes": self.bytes,
            "graphs": self.graphs,
            "groups": self.groups,
            "identity": self.identity.hash(),
            **proof_facts(self.proof),
            "manifest": self.manifest_uri,
            "durations": {k: round(v, 4) for k, v in self.durations.items()},
            **({"tpot_ms": self.tpot_ms} if self.tpot_ms else {}),
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
        "within_native_spread": rep.within_spread,
        "native_nondeterministic": _finite(rep.nondeterministic),
        "nondeterminism_suspects": rep.suspects[:20],
        "proof_notes": rep.notes[:5],
    }


def identity_for(workload: DecodeWorkload) -> ArchiveIdentity:
    """The identity a built-in workload's archive is saved under (LOAD derives the same)."""
    revision = f"seed-{workload.seed}-layers-{workload.spec.layers}"
    if workload.weights:  # a local checkpoint: its config names the shape (the graphs never read
        # weight values, only their addresses, so the weights themselves are not part of it)
        config = (Path(workload.weights) / "config.json").read_bytes()
        revision = f"config-{hashlib.sha256(config).hexdigest()[:16]}-layers-{workload.spec.layers}"
    return ArchiveIdentity(
        model=f"ember-workload/{workload.name}",
        revision=revision,
        engine=ENGINE,
        engine_version=ember.__version__,
        capture_sizes=tuple(workload.sizes),
        graph_mode="full",
        compile={"backend": "inductor", "dynamic": "true"} if workload.compiled else {},
        dtype="bfloat16",
        max_batch=workload.max_batch,
        gpu_product=torch.cuda.get_device_name(),
    )


def execution_order(graph_set: GraphSet, first: list[int]) -> list[str]:
    """Image hashes in the order kernels run: template graphs first, then the rest."""
    seen: dict[str, None] = {}
    order = first + [i for i in range(len(graph_set.graphs)) if i not in set(first)]
    for i in order:
        for node in graph_set.graphs[i].nodes:
            p = node.params
            k = getattr(p, "kernel", None)
            if k is not None:
                seen.setdefault(graph_set.kernels[k].image, None)
    return list(seen)


def run_save(
    workload: DecodeWorkload,
    *,
    store_uri: str | None,
    identity: ArchiveIdentity | None = None,
    allow_in_process: bool = False,
    tpot_batches: tuple[int, ...] = (),
    log: Any = print,
) -> SaveOutcome:
    """SAVE one workload. `store_uri=None` proves without publishing. `tpot_batches`: also time
    the captured graphs' decode step at these batch sizes (a control for `ember bench graphs`:
    native capture in libember's memory layout)."""
    d: dict[str, float] = {}
    t_all = time.perf_counter()
    ip = native_session("save")
    if ip is None and not allow_in_process:
        raise RuntimeError(
            "SAVE needs libember preloaded with EMBER_MODE=save (use `ember save`, which "
            "re-executes itself that way)"
        )
    resolver: KernelResolver = NativeResolver(ip) if ip is not None else LiveResolver()

    t = time.perf_counter()
    workload.build()
    d["build_s"] = time.perf_counter() - t
    if ip is not None:
        ip.capture_begin()
    t = time.perf_counter()
    workload.capture()
    d["capture_s"] = time.perf_counter() - t
    if ip is not None:
        ip.capture_end()
    log(f"Captured {len(workload.graphs)} graphs in {d['capture_s']:.2f} s")
    random = rng_consumers(workload.graphs)
    if random:
        key, inc = next(iter(random.items()))
        raise ProofFailed(
            f"archive NOT published: {len(random)} graphs draw random numbers (e.g. graph {key}: "
            f"Philox offset +{inc} per replay); restored graphs do not advance the generator yet, "
            "so they would repeat the same numbers on every replay. The engine captures natively."
        )

    t = time.perf_counter()
    walker = GraphWalker(resolver)
    graphs = [walker.walk(workload.graphs[(b,)].raw_cuda_graph(), (b,)) for b in workload.sizes]
    graph_set = walker.graph_set(graphs)
    d["walk_s"] = time.perf_counter() - t
    missing = [k for k in graph_set.kernels if not k.image]
    if missing:
        raise ProofFailed(f"{len(missing)} kernels have no catalog entry, e.g. {missing[0].name}")

    t = time.perf_counter()
    rep, table_blob, lib = prove(workload, graph_set, lambda refs: [resolver.function(r) for r in refs])
    d["prove_s"] = time.perf_counter() - t
    if not rep.ok:
        lib.close()
        raise ProofFailed(
            "archive NOT published: "
            + "; ".join(rep.mismatches[:5])
            + "".join(f" [note: {n}]" for n in rep.notes[:2])
            + (f" [kernels only in non-bit-stable graphs: {rep.suspects[:5]}]" if rep.suspects else "")
        )
    log(
        f"Proved {rep.graphs} graphs ({rep.templates} templates, {rep.programmatic_edges} programmatic "
        f"edges kept) in {rep.seconds:.2f} s: {rep.bitwise} bit-identical, {rep.within_spread} within "
        "the native run-to-run spread (captured graph not bit-stable on its own)"
    )
    for note in rep.notes[:3]:
        log(f"Warning: {note}")
    if rep.suspects:
        log(f"Warning: kernels used only by the non-bit-stable graphs: {', '.join(rep.suspects[:8])}")

    # Reference results for other processes, computed with the NATIVE graphs.
    t = time.perf_counter()
    native = lambda k: workload.graphs[k].replay()  # noqa: E731
    keys: list[tuple[int, ...]] = [(b,) for b in workload.sizes]
    prints = replay_fingerprints(workload, native, keys, lambda k: list(workload.outs[k]))
    traces = {str(b): decode_trace(workload, native, b) for b in DECODE_CHECK_BATCHES if b in workload.sizes}
    decode_ref = {b: tr["sha256"] for b, tr in traces.items()}
    tpot = {str(b): tpot_ms(workload, native, b) for b in tpot_batches if b in workload.sizes}
    d["reference_s"] = time.perf_counter() - t
    template_idx = [g.template for g in lib.groups]
    lib.close()

    identity = identity or identity_for(workload)
    images: list[publish.Image] = []
    if ip is not None:
        catalog = {e["hash"]: e for e in ip.catalog()}
        per_image: dict[str, int] = {}
        for k in graph_set.kernels:
            per_image[k.image] = per_image.get(k.image, 0) + 1
        for h in execution_order(graph_set, template_idx):
            e = catalog.get(h, {})
            opts = {"jit": e.get("jit_options", {}), "library": e.get("library_options", {})}
            images.append(
                publish.Image(h, ip.image_bytes(h), e.get("kind", "unknown"), opts, per_image.get(h, 0))
            )
    engine = {
        **workload.config(),
        "kv_cache_bytes": workload.kv_cache_bytes,
        "inputs": workload.input_addresses(),
        "outputs": {
            ",".join(map(str, k)): [o.__dict__ for o in v] for k, v in workload.output_specs().items()
        },
        "fingerprints": prints,
        "decode_sha256": decode_ref,
        "decode_steps": {b: tr["steps"] for b, tr in traces.items()},
        "in_process_only": ip is None,
        **proof_facts(rep),
        "region": list(ip.region()) if ip is not None else None,
    }
    archive = publish.Archive(
        identity=identity,
        compat=compat.current(ENGINE),
        graph_table=table_blob,
        images=images,
        alloc_log=ip.export_alloc_log() if ip is not None else b"",
        rng_state=bytes(torch.cuda.get_rng_state().numpy().tobytes()),
        engine=engine,
    )
    out = SaveOutcome(
        identity=identity,
        graphs=len(graphs),
        groups=rep.templates,
        proof=rep,
        durations=d,
        archive=archive,
        tpot_ms=tpot,
    )
    if store_uri is not None:
        if ip is None:
            raise RuntimeError(
                "an in-process (no libember) SAVE cannot be published: LOAD could not find its kernels"
            )
        t = time.perf_counter()
        out.manifest_uri, out.manifest_digest, out.bytes = publish.write(store_uri, archive, graph_set)
        d["publish_s"] = time.perf_counter() - t
        out.published = True
        log(f"Published {out.manifest_uri} ({out.bytes / 1e6:.1f} MB)")
    d["total_s"] = time.perf_counter() - t_all
    return out


def termination_log(summary: dict[str, Any] | str, path: str = "/dev/termination-log") -> None:
    """Best effort: the operator reads this from the pod status."""
    import json

    text = summary if isinstance(summary, str) else json.dumps(summary, sort_keys=True)
    try:
        with open(os.environ.get("EMBER_TERMINATION_LOG", path), "w") as f:
            f.write(text[:4000])
    except OSError:
        pass
