"""The built-in decode workloads as an engine adapter: `ember save` / `ember load`, the GPU tests
and `ember bench graphs` SAVE and LOAD them through the one pipeline (`ember.runtime.save`,
`ember.runtime.load`).

Keys are `(batch,)` for every capture size. The engine facts hold what LOAD needs to build the
same workload (`DecodeWorkload.config()`), the KV-cache size, the static buffers' addresses, the
graph outputs' layouts, and reference results computed with the NATIVE graphs at SAVE: output
fingerprints of every key and greedy decode histories, which `ember load --verify`,
`ember verify --replay` and the benchmark check in other processes.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ember
from ember.engines.decode.model import DecodeWorkload, OutputSpec
from ember.engines.decode.parallel import SINGLE, Parallel, init_process_group
from ember.identity import ArchiveIdentity, Parallelism, config_digest
from ember.native import Interposer
from ember.runtime.adapter import COMPAT, LOAD, GraphKey, Refused
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.load import Restored, load, open_restore
from ember.runtime.proof.replay import decode_trace, fingerprint, replay_fingerprints, tpot_ms
from ember.runtime.publish import ArchiveContent
from ember.runtime.save import SaveOutcome, save

KIND = "ember-decode"
CANARY_SEED = 11  # the canary's input ids (any seed: both of its steps start from the same state)
DECODE_CHECK_BATCHES = (1, 8, 64)


class DecodeAdapter:
    """One `DecodeWorkload`: built, captured and proven at SAVE; rebuilt from the facts at LOAD."""

    kind = KIND

    def __init__(
        self,
        workload: DecodeWorkload | None = None,
        *,
        model_dir: str | None = None,
        identity: ArchiveIdentity | None = None,
        parallel: Parallel | None = None,
    ) -> None:
        self.workload = workload  # None at LOAD until prepare() builds it from the archive's facts
        # This process's rank and the parallel shape it serves (LOAD: SAVE's must match).
        self.parallel = parallel or (workload.parallel if workload is not None else SINGLE)
        self.model_dir = model_dir  # where this machine holds a `--model DIR` checkpoint (LOAD)
        self.tpot_batches: tuple[int, ...] = ()  # SAVE: also time the captured graphs' decode step
        self.tpot_ms: dict[str, float] = {}
        self.outputs: dict[GraphKey, list[torch.Tensor]] = {}
        self._saved_prints: dict[str, list[int]] = {}  # SAVE's output fingerprints (single GPU)
        self.voted = False  # this rank took part in the canary's first vote (multi-GPU)
        self.library: GraphLibrary | None = None
        self.build_ms = 0.0
        self._identity = identity  # the SAVE Job's, when it names one

    @property
    def engine(self) -> str:
        return KIND

    def _w(self) -> DecodeWorkload:
        assert self.workload is not None, "prepare() first"
        return self.workload

    def check_version(self) -> list[str]:
        return []  # ember's own workload: always the version it knows

    def keys(self) -> list[GraphKey]:
        return [(b,) for b in self._w().sizes]

    def identity(self) -> ArchiveIdentity:
        return self._identity or identity_for(self._w())

    def config_digest(self) -> str:
        return config_digest(asdict(self._w().spec))

    def prepare(self, facts: Mapping[str, Any] | None) -> None:
        t = time.perf_counter()
        if facts is None:
            self._w().build()
        elif self.workload is not None and self.workload.model is not None:
            self._check_prebuilt(facts)  # a warm pod: built before the archive came
        else:
            cfg = dict(facts)
            if self.model_dir:  # the checkpoint lives elsewhere on this machine than where SAVE read it
                cfg["weights"] = str(self.model_dir)
            self.workload = DecodeWorkload.from_config(cfg, rank=self.parallel.rank)
            try:
                self.workload.build(kv_cache_bytes=int(cfg["kv_cache_bytes"]), compile_fn=False)
            except (OSError, ValueError) as exc:  # CheckpointError included: weights missing or other shape
                raise Refused(LOAD, f"model weights not usable: {exc}") from exc
        self.build_ms = (time.perf_counter() - t) * 1e3

    def _check_prebuilt(self, facts: Mapping[str, Any]) -> None:
        w = self._w()
        mine = w.config()
        differ = [k for k in mine if k != "weights" and facts.get(k) != mine[k]]
        if int(facts.get("kv_cache_bytes", -1)) != w.kv_cache_bytes:
            differ.append("kv_cache_bytes")
        if differ:
            raise Refused(LOAD, f"the model built before the archive came differs from SAVE's: {differ}")

    def capture(self) -> dict[GraphKey, Any]:
        return self._w().capture()

    def proof_subject(self, graphs: Mapping[GraphKey, Any]) -> DecodeWorkload:
        return self._w()  # its graphs, outputs and state tensors are what the proof replays

    def facts(self, graphs: Mapping[GraphKey, Any]) -> dict[str, Any]:
        w = self._w()
        base = {
            "kind": KIND,
            **w.config(),
            "kv_cache_bytes": w.kv_cache_bytes,
            "inputs": w.input_addresses(),
            "outputs": {",".join(map(str, k)): [o.__dict__ for o in v] for k, v in w.output_specs().items()},
        }
        if self.parallel.moves_data:
            # One GPU playing rank 0 ran placeholders, not collectives: its outputs are no
            # reference for any rank. `ember bench graphs --tp/--ep/--dp` compares every rank
            # with a native multi-rank capture instead. (Data-parallel replicas move no data:
            # their SAVE's outputs are every rank's.)
            return {**base, "fingerprints": {}, "decode_sha256": {}, "decode_steps": {}}
        native = lambda k: w.graphs[k].replay()  # noqa: E731
        keys = self.keys()
        prints = replay_fingerprints(w, native, keys, lambda k: list(w.outs[k]))
        traces = {str(b): decode_trace(w, native, b) for b in DECODE_CHECK_BATCHES if b in w.sizes}
        self.tpot_ms = {str(b): tpot_ms(w, native, b) for b in self.tpot_batches if b in w.sizes}
        return {
            **base,
            "fingerprints": prints,
            "decode_sha256": {b: tr["sha256"] for b, tr in traces.items()},
            "decode_steps": {b: tr["steps"] for b, tr in traces.items()},
        }

    def accept(self, facts: Mapping[str, Any]) -> None:
        # Archives from before the engine facts named their kind have "workload" and no "kind".
        if facts.get("kind", KIND) != KIND or "workload" not in facts:
            raise Refused(COMPAT, f"archive is not an {KIND} archive ({facts.get('kind')})")
        saved = Parallel(**facts.get("parallel", {}))
        if saved.degrees() != self.parallel.degrees():
            raise Refused(COMPAT, f"archive saved for parallel shape {saved.degrees()}, "
                                  f"this process serves {self.parallel.degrees()}")

    def communicator(self) -> tuple[int, int, int] | None:
        """(ncclComm_t, world, rank) for splicing collectives, None for a single-GPU shape."""
        from ember.runtime.comm import torch_communicator

        par = self.parallel
        return (torch_communicator(), par.world, par.rank) if par.active else None

    def static_addresses(self) -> dict[str, int]:
        return self._w().input_addresses()

    def install(self, library: GraphLibrary, archive: ArchiveContent) -> int:
        if archive.rng_state:
            state = np.frombuffer(archive.rng_state, dtype=np.uint8).copy()
            torch.cuda.set_rng_state(torch.from_numpy(state))
        self.outputs = {
            tuple(int(x) for x in k.split(",")): [OutputSpec(**o).tensor() for o in v]
            for k, v in archive.engine["outputs"].items()
        }
        self.library = library
        self._saved_prints = dict(archive.engine.get("fingerprints", {}))
        return len(library.keys)

    def verify(self, library: GraphLibrary) -> dict[str, Any]:
        """LOAD's canary (`ember.runtime.verify`): the first needed key's graph — as instantiated,
        after an exec update, on its own exec — against SAVE's fingerprint of its native graph
        where SAVE saw real data (one GPU, or data-parallel replicas: no collective), or against
        the workload's own eager step on every rank of a shape whose collectives SAVE only
        recorded (Refused on any difference). A compiled step of such a shape is not checked:
        its eager step is not the compiled one."""
        from ember.runtime import verify
        from ember.runtime.graphs.driver import launch_exec

        w, par = self._w(), self.parallel
        index = library.order[0]
        key, b = library.keys[index], library.keys[index][0]
        if par.world > 1:  # every rank got here (a rank that refused earlier votes no: load_workload)
            self.voted = True
            if not verify.unanimous(True, par.world):
                raise Refused(verify.VERIFY, f"rank {par.rank}: a peer refused the archive before the canary")
        # SAVE saw real data (no collective): it fingerprinted its native graphs from
        # reset_state(seed 7), smallest key first (one launch here; an eager step costs its
        # kernels' first loads, ~0.5 s on a fresh rank)
        saved = self._saved_prints.get(f"{b}") if not par.moves_data and key == min(library.keys) else None
        if saved is None and w.compiled:
            return {"verify": "skipped: a compiled multi-GPU step has no reference here"}
        seed = 7 if saved is not None else CANARY_SEED

        whole = [True]

        def reset() -> None:
            """Every path's start; the key's outputs poisoned (a path that wrote none of them must
            not pass on what an earlier path left there). The whole cache zeroed once, then only
            what each path's one step wrote."""
            w.reset_state(seed=seed, one_step_of=None if whole[0] else b)
            whole[0] = False
            for t in self.outputs[key]:
                t.view(torch.uint8).fill_(0xA5)

        def outputs() -> list[Any]:
            return fingerprint(self.outputs[key]) if saved is not None else self.outputs[key]

        def via_template() -> list[Any]:
            library.launch_template(index)
            return outputs()

        own = library.own.get_ahead(index)  # built while the reference and template paths run

        def via_own_exec() -> list[Any]:
            launch_exec(own.result())
            return outputs()

        reference = saved if saved is not None else (lambda: list(w.step(b)))
        trip = verify.round_trip(library, index)
        result = verify.canary(reference, via_template, reset, trip, via_own_exec)
        return verify.settle(result, par.world, par.rank)

    def report(self, stage: str, **fields: Any) -> None:
        pass  # the commands and the benchmark print their own summaries

    def launch(self, key: GraphKey) -> None:
        assert self.library is not None
        self.library.launch(self.library.key_index(key))


def identity_for(workload: DecodeWorkload) -> ArchiveIdentity:
    """The identity a built-in workload's archive is saved under (LOAD derives the same)."""
    settings = {"seed": str(workload.seed), "layers": str(workload.spec.layers)}
    if workload.weights:  # a local checkpoint: its config names the shape (the graphs never read
        # weight values, only their addresses, so the weights themselves are not part of it)
        config = (Path(workload.weights) / "config.json").read_bytes()
        settings["checkpoint_config"] = hashlib.sha256(config).hexdigest()[:16]
    par = workload.parallel
    if par.collectives:
        settings["collectives"] = "true"  # collectives in a world of one: the splice check
    return ArchiveIdentity(
        model=f"ember-workload/{workload.name}",
        workload=settings,
        parallelism=Parallelism(tensor=par.tensor, expert=par.expert, data=par.data),
        engine=KIND,
        engine_version=ember.__version__,
        capture_sizes=tuple(workload.sizes),
        graph_mode="full",
        compile=({"backend": "inductor", "dynamic": "true", "deterministic": "true"} if workload.compiled
                 else {}),
        dtype="bfloat16",
        max_batch=workload.max_batch,
        gpu_product=torch.cuda.get_device_name(),
        config=config_digest(asdict(workload.spec)),
    )


def save_workload(
    workload: DecodeWorkload,
    *,
    store_uri: str | None,
    identity: ArchiveIdentity | None = None,
    allow_in_process: bool = False,
    tpot_batches: tuple[int, ...] = (),
    log: Callable[[str], None] = print,
) -> SaveOutcome:
    """SAVE one workload (`store_uri=None` proves without publishing). `tpot_batches`: also time
    the captured graphs' decode step at these batch sizes (a control for `ember bench graphs`:
    native capture in libember's memory layout). `identity`: the SAVE Job's, when given."""
    from ember.runtime.session import native_session

    ip = native_session("save")
    if ip is None and not allow_in_process:
        raise RuntimeError(
            "SAVE needs libember preloaded with EMBER_MODE=save (use `ember save`, which "
            "re-executes itself that way)"
        )
    if ip is None and store_uri is not None:
        raise RuntimeError(
            "an in-process (no libember) SAVE cannot be published: LOAD could not find its kernels"
        )
    init_process_group(workload.parallel, stub=True)  # rank 0 of the world, under libember_nccl
    adapter = DecodeAdapter(workload, identity=identity)
    adapter.tpot_batches = tpot_batches
    result = save(adapter, ip, store_uri, log=log)
    if adapter.tpot_ms:
        result.extra["tpot_ms"] = adapter.tpot_ms
    return result


@dataclass
class Loaded:
    """A decode LOAD: the workload rebuilt, its graphs restored, SAVE's reference results."""

    adapter: DecodeAdapter
    restored: Restored
    timings: dict[str, Any]

    @property
    def workload(self) -> DecodeWorkload:
        return self.adapter._w()

    @property
    def library(self) -> GraphLibrary:
        return self.restored.library

    @property
    def archive(self) -> ArchiveContent:
        return self.restored.archive

    @property
    def outputs(self) -> dict[GraphKey, list[torch.Tensor]]:
        return self.adapter.outputs

    def launch(self, key: GraphKey) -> None:
        self.adapter.launch(key)


def load_workload(
    store_uri: str,
    identity_hash: str,
    *,
    interposer: Interposer | None = None,
    perturb_first: bool = False,
    log: Callable[[str], None] = print,
    model_dir: str | None = None,
    prebuilt: DecodeWorkload | None = None,
    parallel: Parallel | None = None,
    wait_templates: bool = True,
) -> Loaded:
    """LOAD one archive into this process (Refused: capture natively). `model_dir`: where this
    machine holds the checkpoint of a `--model DIR` archive (default: where SAVE read it).
    `prebuilt`: a workload built before the archive came (a warm pod), checked against SAVE's.
    `parallel`: this process's rank of a multi-GPU shape (its communicator is created first, as
    the engine would natively; LOAD splices this rank's collectives with it). `load_ms` runs until
    every group's template is instantiated (`load_first_ms`: until the first is and the library
    is handed over); `wait_templates=False` returns at the hand-over (the true-cost bench times
    the rest itself)."""
    from ember.runtime.session import native_session

    tm: dict[str, Any] = {}
    t_all = time.perf_counter()
    ip = interposer or native_session("load", perturb_first=perturb_first)
    tm["session_ms"] = (time.perf_counter() - t_all) * 1e3
    par = parallel or (prebuilt.parallel if prebuilt is not None else SINGLE)
    t = time.perf_counter()
    init_process_group(par, stub=False)
    tm["communicator_ms"] = (time.perf_counter() - t) * 1e3
    adapter = DecodeAdapter(prebuilt, model_dir=model_dir, parallel=par)
    try:
        restored = load(adapter, open_restore(adapter, ip, store_uri, identity_hash))
    except Refused:
        if par.world > 1 and not adapter.voted:  # the peers wait in the canary's first vote
            from ember.runtime.verify import unanimous

            unanimous(False, par.world)
        raise
    t_first = time.perf_counter()
    if wait_templates:
        restored.library.wait_templates()
    tm["build_workload_ms"] = adapter.build_ms
    tm["total_ms"] = (time.perf_counter() - t_all) * 1e3
    outside = tm["build_workload_ms"] + tm["session_ms"] + tm["communicator_ms"]
    tm["load_first_ms"] = (t_first - t_all) * 1e3 - outside
    tm["load_ms"] = tm["total_ms"] - outside
    tm.update(restored.timings)
    if wait_templates:  # the background thread has written the other templates' timings
        tm.update(restored.background)
    log(
        f"Loaded {restored.graphs} graphs ({len(restored.library.groups)} templates) "
        f"in {tm['load_ms']:.1f} ms "
        f"(+{tm['build_workload_ms']:.0f} ms building the model)"
    )
    return Loaded(adapter, restored, tm)
