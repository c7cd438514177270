"""LOAD's vLLM canary on the GPU: the steps of `ember.engines.vllm.canary` through vLLM's own
dummy run, native graphs (SAVE's record), restored ones (LOAD) or none (the eager reference).

Each restored step runs through `Routed` graphs put where the engine looks for the duration of
the canary, so a path chooses how every key of the step launches: through its group's template
(exec updates between the step's keys) or through the key's own exec. Every path launches every
key of the step once; a path that did not (vLLM dispatched the step otherwise) refuses. Capture
is off meanwhile (`no_capture`): a step vLLM would capture instead of replaying raises, and a
raising canary refuses.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ember import settings
from ember.engines.vllm import canary
from ember.engines.vllm import graphs as sites
from ember.engines.vllm.canary import Case
from ember.runtime import verify
from ember.runtime.graphs.driver import launch_exec
from ember.runtime.profiled import profiled
from ember.runtime.proof.pool_check import DeviceBytes, pointers
from ember.runtime.proof.replay import fingerprint, fingerprints_on_device, warm_fingerprints

log = logging.getLogger("ember.vllm")
POISON = canary.POISON


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """vLLM's capture switch off: a step that would capture raises instead (`validate_...`)."""
    from vllm.compilation import monitor

    was = bool(monitor.cudagraph_capturing_enabled)
    monitor.set_cudagraph_capturing_enabled(False)
    try:
        yield
    finally:
        monitor.set_cudagraph_capturing_enabled(was)


class Steps:
    """One engine's canary steps: state, a run in a mode, the step's outputs poisoned."""

    def __init__(self, runner: Any, kind: str, facts: Mapping[str, Any],
                 scratch: Mapping[str, Sequence[Sequence[int]]] | None = None) -> None:
        self.runner, self.kind, self.facts = runner, kind, facts
        self.ranges = scratch or {}  # per case: (address, bytes) of its scratch
        self._outputs: dict[str, list[torch.Tensor]] = {}
        self._compared: dict[str, list[list[int]]] = {}
        self._scratch: dict[str, list[torch.Tensor]] = {}
        self._ids: dict[int, torch.Tensor] = {}
        self._kv: tuple[list[str], int] | None = None  # the KV cache groups' specs, decode query length
        self.kv_runs = 0  # FULL steps over real KV so far: each takes its own blocks (`canary.kv_layout`)
        self.rebuilt_ms: dict[str, float] = {}  # per case: its outputs rebuilt (in its first reset)

    def _kv_run(self, case: Case) -> int | None:
        """This run's number among the steps over real KV, None where `case`'s step writes none."""
        if not self.writes_kv(case):
            return None
        self.kv_runs += 1
        return self.kv_runs - 1

    def writes_kv(self, case: Case) -> bool:
        """Whether `case`'s step writes and reads real KV slots (`canary.writes_kv`)."""
        if self._kv is None:
            self._kv = kv_specs(self.runner, self.kind)
        return canary.writes_kv(case, *self._kv)

    def reset(self, case: Case, scratch: bool = True) -> None:
        """Every run's start: V1's input ids seeded and positions zero (V2's dummy batch zeroes
        both itself), the step's graph outputs and (`scratch`) its scratch poisoned, a fill each:
        0.5 ms for 70 outputs, and the fill kernel is loaded long before (one `torch._foreach_copy_`
        would cost its kernel's first load, 17 ms, in the first reset; h200-20261201c)."""
        n = case.num_tokens
        if self.kind == "v1":
            ids = _gpu(self.runner.input_ids)[:n]
            if (seeded := self._ids.get(n)) is None:
                vocab = int(self.runner.model_config.get_vocab_size())
                gen = torch.Generator(device="cpu").manual_seed(canary.SEED)
                seeded = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64).to(ids.dtype)
                seeded = self._ids[n] = seeded.to(ids.device)
            ids.copy_(seeded)
            _gpu(self.runner.positions)[..., :n].zero_()
        for t in self.outputs(case):
            if t.is_contiguous():
                t.view(torch.uint8).fill_(POISON)
            else:
                t.fill_(-3)
        for t in self.scratch(case) if scratch else ():
            t.fill_(POISON)

    def scratch(self, case: Case) -> list[torch.Tensor]:
        """The case's scratch as byte tensors over the graphs' memory, made once per case."""
        if (got := self._scratch.get(case.name)) is None:
            ranges = self.ranges.get(case.name) or []
            got = self._scratch[case.name] = [_bytes_at(int(a), int(n)) for a, n in ranges]
        return got

    def outputs(self, case: Case) -> list[torch.Tensor]:
        """The step's graph outputs that may be poisoned (`canary.poison_targets`), rebuilt once per
        case: every reset poisons them (3 or 4 a case; a full-depth step's ~70 tensors over fixed
        addresses take 1–2 ms to rebuild)."""
        if (got := self._outputs.get(case.name)) is not None:
            return got
        t0 = time.perf_counter()
        specs = self.facts.get("outputs") or {}
        per_key = [sites.flat_tensors(sites.rebuild(specs.get(_name(k)))) for k in case.keys]
        tensors = [t for ts in per_key for t in ts]
        reads = [a for k in case.keys for a in (self.facts.get("input_addresses") or {}).get(_name(k), [])]
        keep = canary.poison_targets([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], reads)
        got = self._outputs[case.name] = [tensors[i] for i in keep]
        spans = [_span(t) for t in got if t.is_contiguous()]
        self._compared[case.name] = [[j for j, t in enumerate(ts) if canary.inside(_span(t), spans)]
                                     for ts in per_key]
        self.rebuilt_ms[case.name] = (time.perf_counter() - t0) * 1e3
        return got

    def compared(self, case: Case) -> list[list[int]]:
        """Per piece of the case, in launch order: which of the outputs it returns the per-piece
        prints compare, by position. Those inside what every reset sets whole (the contiguous
        poisoned outputs): a piece also returns buffers it does not write (the one attention
        fills), which hold what an earlier step left in the graphs' memory and whatever the
        allocator held in an eager step's."""
        self.outputs(case)
        return self._compared[case.name]

    def run(self, case: Case, graphs: bool) -> torch.Tensor:
        """One dummy step of `case`, through graphs or without (NONE); its hidden states."""
        n = case.num_tokens
        if self.kind == "v1":
            from vllm.config import CUDAGraphMode

            mode = CUDAGraphMode.NONE
            if graphs:
                mode = CUDAGraphMode.FULL if case.full else CUDAGraphMode.PIECEWISE
            # a FULL step's attention metadata as the capture built it (max_seq_len, splits)
            with real_kv(self.runner, self.kind, n, self._kv_run(case)):
                hidden, _ = self.runner._dummy_run(
                    n, cudagraph_runtime_mode=mode, force_attention=case.full, uniform_decode=case.uniform,
                    allow_microbatching=False, skip_eplb=True, remove_lora=False,
                    is_graph_capturing=case.full)
        else:  # V2: the manager dispatches to the graphs; a profile run is eager (NONE)
            with piecewise_dispatch(self.runner, case if graphs else None), \
                    real_kv(self.runner, self.kind, n, self._kv_run(case)):
                hidden, _ = self.runner._dummy_run(n, uniform_decode=case.uniform, skip_eplb=True,
                                                   is_profile=not graphs)
        if hidden is None:
            raise RuntimeError("the dummy step returned no hidden states (not the last pipeline rank?)")
        return hidden[:n]


def kv_specs(runner: Any, kind: str) -> tuple[list[str], int]:
    """The engine's KV cache groups (their spec class names) and its decode query length, for
    `canary.writes_kv`; no groups where the cache is split across context-parallel ranks."""
    try:
        specs = [type(g.kv_cache_spec).__name__ for g in runner.kv_cache_config.kv_cache_groups]
        if kind == "v1":
            query, cp = int(runner.uniform_decode_query_len), int(getattr(runner, "dcp_world_size", 1))
        else:
            query, cp = int(runner.decode_query_len), int(runner.block_tables.cp_size)
    except AttributeError as exc:  # another vLLM: the FULL step keeps PAD slots (blind to q, k, v)
        log.warning("ember: the canary's FULL step writes no KV here (%s)", exc)
        return [], 0
    return (specs if cp == 1 else []), query


def write_kv(groups: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]], seq_lens: torch.Tensor,
             n: int, run: int) -> list[torch.Tensor]:
    """A dummy step of `n` one-token requests made to write and read real KV (`canary.kv_layout`):
    per KV cache group (its block table, slot mapping, kernel block size and kernel blocks) each
    request's row and each token's slot, and every request's sequence length n. Returns the block
    table entries it wrote."""
    rows: list[torch.Tensor] = []
    for table, slots, block_size, blocks in groups:
        lay = canary.kv_layout(n, block_size, blocks, run)
        row = torch.tensor(lay.blocks, dtype=table.dtype)
        rows.append(table[:n, : len(lay.blocks)])
        rows[-1].copy_(row.expand(n, -1))
        slots[:n].copy_(torch.tensor(lay.slots, dtype=slots.dtype))
    if rows:
        seq_lens[:n] = n  # every request attends over all n slots
    return rows


@contextlib.contextmanager
def real_kv(runner: Any, kind: str, n: int, run: int | None) -> Iterator[None]:
    """While a FULL canary step runs (`run`: its number among such steps; None: PAD slots kept):
    its slots, block table rows and sequence lengths written (`write_kv`) after vLLM's dummy run
    set them (PAD slots, a fresh engine's rows, length 1) and before its attention metadata is
    built from them, so the backend plans for them. Afterwards the rows are a fresh engine's again
    (zero): V2's dummy steps reuse the forward's rows as they are."""
    if run is None:
        yield
        return
    blocks = int(runner.kv_cache_config.num_blocks)
    rows: list[torch.Tensor] = []
    if kind == "v1":
        name, original = "_build_attention_metadata", runner._build_attention_metadata

        def patched(*args: Any, **kwargs: Any) -> Any:
            groups = []
            for gid, slots in (kwargs.get("slot_mappings") or {}).items():
                bt = runner.input_batch.block_table[gid]
                per = int(getattr(bt, "blocks_per_kv_block", 1))
                groups.append((bt.block_table.gpu, slots, int(bt.block_size), blocks * per))
            runner.optimistic_seq_lens_cpu[:n] = n  # what the metadata's CPU side reads
            rows.extend(write_kv(groups, runner.seq_lens, n, run))
            return original(*args, **kwargs)
    else:
        name, original = "prepare_dummy_attn", runner.prepare_dummy_attn

        def patched(*args: Any, **kwargs: Any) -> Any:
            tables, slots = original(*args, **kwargs)
            batch, bts = (args[0] if args else kwargs["input_batch"]), runner.block_tables
            groups = [(t, slots[g], int(bts.kernel_block_sizes[g]), blocks * int(bts.blocks_per_kv_block[g]))
                      for g, t in enumerate(tables)]
            rows.extend(write_kv(groups, batch.seq_lens, n, run))
            if getattr(batch, "seq_lens_cpu_upper_bound", None) is not None:
                batch.seq_lens_cpu_upper_bound[:n] = n
            return tables, slots

    had = name in vars(runner)
    setattr(runner, name, patched)
    try:
        yield
    finally:  # the class's method again (or what the runner held itself)
        setattr(runner, name, original) if had else delattr(runner, name)
        for r in rows:
            r.zero_()


@contextlib.contextmanager
def piecewise_dispatch(runner: Any, case: Case | None) -> Iterator[None]:
    """V2, a PIECEWISE case: its dummy step dispatched to the size's PIECEWISE graphs. V2's dummy
    batch of n <= max_num_reqs tokens is n one-token requests, which its manager gives a FULL
    decode graph where there is one (`CudaGraphManager.dispatch`: candidates by priority)."""
    if case is None or case.full:
        yield
        return
    manager = runner.cudagraph_manager
    original = manager.dispatch

    def dispatch(num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                 num_active_loras: int = 0) -> Any:
        if num_tokens == case.num_tokens:
            for desc in manager._candidates.get((num_tokens, num_active_loras), []):
                if getattr(desc.cg_mode, "name", "") == "PIECEWISE":
                    return desc
        return original(num_reqs, num_tokens, uniform_token_count, num_active_loras=num_active_loras)

    manager.dispatch = dispatch
    try:
        yield
    finally:
        del manager.dispatch  # the class's method again


class Routed:
    """A restored graph for the canary's paths: through its template or its own exec. `spent`
    sums the host milliseconds of its launches (exec updates included)."""

    def __init__(self, library: Any, index: int, route: list[str], launched: list[int],
                 spent: list[float]) -> None:
        self.library, self.index, self.route = library, index, route
        self.launched, self.spent = launched, spent

    def replay(self, stream: Any = None) -> None:
        t = time.perf_counter()
        self.launched.append(self.index)
        if self.route[0] == "own":
            launch_exec(self.library.own.get(self.index), stream)
        else:
            self.library.launch_template(self.index, stream)
        self.spent[0] += (time.perf_counter() - t) * 1e3

    def reset(self) -> None:
        pass


class Prints:
    """The fingerprints of each PIECEWISE piece's outputs a step queued on the device, in launch
    order: of piece i's returned outputs those at the positions `compared[i]` names
    (`Steps.compared`). Positions, not addresses: an eager step's pieces return the same outputs in
    fresh memory, so the same prints compare a restored step with an eager one (N ranks)."""

    def __init__(self, compared: Sequence[Sequence[int]] = ()) -> None:
        self.compared = [list(c) for c in compared]
        self.pending: list[torch.Tensor] = []
        self.calls = 0  # the pieces the step ran

    def clear(self) -> None:
        self.pending, self.calls = [], 0

    def add(self, outputs: list[torch.Tensor]) -> None:
        at = self.compared[self.calls] if self.calls < len(self.compared) else []
        self.calls += 1
        chosen = [outputs[j] for j in at if j < len(outputs)]  # fewer outputs: the prints differ
        if chosen:
            self.pending.append(fingerprints_on_device(chosen))

    def tensor(self) -> torch.Tensor:
        return torch.cat(self.pending) if self.pending else torch.zeros(0, dtype=torch.int64)

    def read(self) -> list[int]:
        return [int(x) for x in self.tensor().tolist()]

    def step(self, steps: Steps, case: Case, graphs: bool) -> torch.Tensor:
        """One run of the case's step: its hidden states; each piece's prints queued here."""
        self.clear()
        with piece_prints(self, case):
            return steps.run(case, graphs=graphs)


@contextlib.contextmanager
def piece_prints(prints: Prints, case: Case) -> Iterator[None]:
    """A PIECEWISE case: while its step runs, each piece's outputs fingerprinted on the device as
    the piece returns them (vLLM's `CUDAGraphWrapper.__call__`: the replay's static outputs, or
    what the piece computed without graphs). The step is then checked piece by piece, the q, k and
    v each piece hands to attention included (the dummy step's attention never reads them), not
    only by its hidden states; each fingerprint is queued before a later piece can reuse that
    memory. A FULL case's pieces do not run apart: nothing is added."""
    if case.full or not prints.compared:
        yield
        return
    cls = sites.wrapper_class()
    original = cls.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if getattr(self.runtime_mode, "name", None) == "PIECEWISE":
            prints.add(sites.flat_tensors(out))
        return out

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = original


def own_execs(library: Any, indices: list[int]) -> None:
    """The keys' own execs, built as the Dedicator builds them, in one builder call."""
    missing = [i for i in indices if not library.own.has(i)]
    if missing:
        built = library.own.build(missing)
        library.upload([ex for _, ex in built])
        for i, ex in built:
            library.own.adopt(i, ex)


def check_case(steps: Steps, case: Case, library: Any, saved: list[int] | None,
               every_path: bool) -> tuple[dict[str, Any], str]:
    """`verify.canary` over one step; returns its result and a problem found on the way (a path
    that did not launch every key of the step). The keys' own execs are built before the first
    step: built on a thread beside the steps, they cost the steps as much as they saved
    (h200-20261201c: vLLM's step is Python, and so is the build's preparation)."""
    indices = [library.key_index(k) for k in case.keys]
    route: list[str] = ["template"]
    launched: list[int] = []
    spent = [0.0]
    graph_ms: list[float] = []  # each step's host time in the restored graphs' launches
    print_ms: list[float] = []  # each step's fingerprint, from the step's end on the GPU
    problem: list[str] = []

    own, build_ms = _build_own(library, indices, case, problem)
    prints = Prints(steps.compared(case))

    def via(path: str) -> list[Any]:
        route[0], spent[0] = path, 0.0
        launched.clear()
        hidden = prints.step(steps, case, True)
        graph_ms.append(round(spent[0], 2))
        if sorted(set(launched)) != sorted(indices) and not problem:
            problem.append(f"{case.name}: the {path} step launched {len(set(launched))} of its "
                           f"{len(indices)} restored graphs (vLLM did not dispatch it to them)")
        if saved is None:  # against the eager step: its end and its pieces' prints, on the device
            return [hidden, prints.tensor()]
        if torch.cuda.is_available():  # the step's end: what follows is the fingerprint's own time
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = fingerprint([hidden]) + prints.read()  # the step's end, then each piece's outputs
        print_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
        return got

    def trip() -> bool:  # every key's template to another member and back; always a step after
        for i in indices:
            try:  # no collective here: a failed update must not break the ranks' lockstep either
                verify.round_trip(library, i, _trip_member(library, i))()
            except Exception as exc:
                problem.append(f"{case.name}: exec update of {library.keys[i]}: {type(exc).__name__}: {exc}")
        return True

    def eager() -> list[Any]:
        hidden = prints.step(steps, case, False)
        return [hidden, prints.tensor()]

    reference: Any = list(saved) if saved is not None else eager
    with routed(steps.runner, library, case, route, launched, spent):
        result = verify.canary(reference, lambda: via("template"), lambda: steps.reset(case), trip,
                               lambda: via(own), every_path=every_path, reset_after=False)
    parts = result["parts_ms"]
    parts["own exec build"] = round(build_ms, 2)
    parts["outputs rebuilt"] = round(steps.rebuilt_ms.get(case.name, 0.0), 2)  # in the first reset
    calls = zip(result["checked"], graph_ms, strict=False)  # the paths that ran a step, in order
    parts.update({f"{name} graph calls": ms for name, ms in calls})
    parts.update({f"{name} fingerprint": ms for name, ms in zip(result["checked"], print_ms, strict=False)})
    result["verify_ms"] += build_ms
    result["pieces"] = len(prints.pending)  # pieces whose outputs the last step compared
    return result, (problem[0] if problem else "")


def _build_own(library: Any, indices: list[int], case: Case, problem: list[str]) -> tuple[str, float]:
    """The keys' own execs, built before any step (a build that fails on one rank must not break
    the ranks' lockstep): the own-exec path's route ("template" where the build failed: the same
    launches as every other rank's) and the build's milliseconds."""
    t = time.perf_counter()
    try:
        own_execs(library, indices)
        own = "own"
    except Exception as exc:
        problem.append(f"{case.name}: its own execs could not be built: {type(exc).__name__}: {exc}")
        own = "template"
    return own, (time.perf_counter() - t) * 1e3


@contextlib.contextmanager
def routed(runner: Any, library: Any, case: Case, route: list[str], launched: list[int],
           spent: list[float]) -> Iterator[None]:
    """The step's restored graphs replaced by `Routed` ones while the canary runs."""
    mine = {k: Routed(library, library.key_index(k), route, launched, spent) for k in case.keys}
    before = sites.replace(runner, mine)
    try:
        yield
    finally:
        sites.replace(runner, before)


def run(runner: Any, kind: str, library: Any, facts: Mapping[str, Any], world: int) -> dict[str, Any]:
    """LOAD's canary over every case (`canary.combine`); the caller takes the ranks' verdict."""
    # the scratch SAVE recorded, where LOAD mapped the restored graphs' memory (libember's region)
    region = facts.get("region")
    scratch = {name: canary.within(r, region) for name, r in (facts.get("scratch") or {}).items()}
    steps = Steps(runner, kind, facts, scratch)
    # EMBER_VLLM_CANARY_EAGER: one GPU checks against eager steps as N ranks do (a test of that path)
    saved = None if settings.on("EMBER_VLLM_CANARY_EAGER") else facts.get("canary")
    full_eager = settings.on("EMBER_VLLM_CANARY_FULL_EAGER")
    results: dict[str, dict[str, Any]] = {}
    unchecked: list[str] = []
    problems: list[str] = []
    wrote_kv: list[str] = []
    warm_ms = 0.0
    with torch.inference_mode(), no_capture(), \
            profiled(settings.text("EMBER_VLLM_CANARY_PROFILE"), "canary"):
        if torch.cuda.is_available():  # its own part: the kernels' first load, apart from the steps
            warm_ms = warm_fingerprints(torch.cuda.current_device())
        for case in canary.cases(library.keys, settings.on("EMBER_VLLM_CANARY_EVERY_FULL")):
            kv = steps.writes_kv(case)
            how = canary.plan(case, world, saved, full_eager, kv)
            if how == canary.UNCHECKED:
                unchecked.append(case.name)
                continue
            fp = canary.saved_fingerprint(saved, case, kv) if how == canary.SAVED else None
            wrote_kv += [case.name] if kv else []
            results[case.name], problem = check_case(steps, case, library, fp, every_path=world > 1)
            problems += [problem] if problem else []
    out = canary.combine(results, unchecked)
    out["parts_ms"]["fingerprint kernels"] = round(warm_ms, 2)
    out["verify_ms"] += warm_ms
    out["kv"] = wrote_kv  # the cases whose step wrote and read real KV slots
    # what was poisoned beside the outputs, per case (bytes), and what SAVE found and dropped
    out["scratch"] = {"bytes": {name: sum(n for _, n in r) for name, r in scratch.items()},
                      "ranges": {name: [f"{a:#x}+{n}" for a, n in r[:12]] for name, r in scratch.items()},
                      "found": facts.get("scratch_found"),
                      "dropped": (saved or {}).get("scratch_dropped")}
    if unchecked:  # in the report too (`checked`): not silent, not a refusal (docs/runtime.md)
        log.warning("ember: LOAD's canary has no reference for the %s step here", ", ".join(unchecked))
    if problems and out["ok"]:
        out.update(ok=False, why=problems[0])
    return out


def scratch(captured: Mapping[Any, Any],
            cases: list[Case]) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    """SAVE, after the capture: per case, the graph pool's free memory its graphs' nodes point
    into, less the step's tensor arguments (`canary.scratch_ranges`), and what was found (the
    LOAD report's `verify.scratch`). `captured`: key → the adapter's `Captured` (its graph,
    output and inputs)."""
    from ember.runtime.graphs.kernels import LiveResolver
    from ember.runtime.graphs.walk import GraphWalker

    device = torch.cuda.current_device()
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device") == device]
    outputs = [t.data_ptr() for c in captured.values() for t in sites.flat_tensors(c.output)]
    pools = canary.graph_pools(segments, outputs)
    free = canary.pool_blocks(segments, pools)
    live = canary.pool_blocks(segments, pools, "active_allocated")
    walker = GraphWalker(LiveResolver())
    out: dict[str, list[list[int]]] = {}
    found: dict[str, Any] = {"free_blocks": len(free), "live_blocks": len(live), "segments": len(segments),
                             "outputs": len(outputs), "pools": [list(p) for p in sorted(pools)],
                             "bytes_by_state": canary.block_states(segments, pools)}
    for case in cases:
        graphs = [walker.walk(captured[k].graph.raw_cuda_graph(), k) for k in case.keys]
        words = [v for g in graphs for _, v in pointers(g)]
        keep = [_span(t) for k in case.keys for t in captured[k].inputs]
        out[case.name] = [list(r) for r in canary.scratch_ranges(words, free, keep)]
        hit = canary.scratch_ranges(words, free, [])
        found[case.name] = {"words": len(words), "free_hit_bytes": sum(n for _, n in hit),
                            "scratch_bytes": sum(n for _, n in out[case.name]),
                            "live_hit_bytes": sum(n for _, n in canary.scratch_ranges(words, live, []))}
    return out, found


def record(runner: Any, kind: str, keys: list[Any],
           facts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """SAVE (one GPU): each case's step through the NATIVE graphs from the canary's state, its
    scratch poisoned, fingerprinted (`canary.record`); a case that cannot run, or whose two runs
    differ, records why instead. Returns the record and the scratch LOAD may poison: a case whose
    plain step (scratch not poisoned) differs reads it before writing it, and keeps none."""
    kept = {name: list(r) for name, r in (facts.get("scratch") or {}).items()}
    steps = Steps(runner, kind, facts, kept)
    prints: dict[str, list[int] | str] = {}
    dropped: list[str] = []
    cases = canary.cases(keys)
    with torch.inference_mode(), no_capture():
        for case in cases:
            try:
                prints[case.name] = got = _stable(steps, case, True)
                if steps.scratch(case) and (plain := _stable(steps, case, False)) != got:
                    log.warning("ember: SAVE's canary step %s reads its scratch before writing it: "
                                "LOAD poisons its outputs only", case.name)
                    kept[case.name], prints[case.name] = [], plain
                    dropped.append(case.name)
            except Exception as exc:
                prints[case.name] = f"{type(exc).__name__}: {exc}"
            if isinstance(prints[case.name], str):  # LOAD checks it against an eager step, or not at all
                log.warning("ember: SAVE's canary step %s: %s", case.name, prints[case.name])
    kv = [c.name for c in cases if steps.writes_kv(c)]
    return {**canary.record(cases, prints, kv), "scratch_dropped": dropped}, kept


def _stable(steps: Steps, case: Case, scratch: bool) -> list[int] | str:
    """The step's fingerprint (its end, then each piece's outputs), twice the same (a fingerprint
    LOAD could not reproduce would refuse every restore), else why not."""
    runs = []
    prints = Prints(steps.compared(case))
    for _ in range(2):
        steps.reset(case, scratch)
        hidden = prints.step(steps, case, True)
        if not case.full and prints.calls != len(case.keys):
            return f"the native step ran {prints.calls} pieces, not its {len(case.keys)}"
        runs.append(fingerprint([hidden]) + prints.read())
    return runs[0] if runs[0] == runs[1] else "the native step is not bit-stable"


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    return torch.as_tensor(DeviceBytes(address, nbytes), device="cuda")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) a tensor view covers."""
    if t.numel() == 0:
        return (t.data_ptr(), 0)
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), (last + 1) * t.element_size())


def _trip_member(library: Any, index: int) -> int | None:
    members = library.group_members(index)
    at = canary.trip_member(library.keys[index], [library.keys[m] for m in members])
    return None if at is None else members[at]


def _gpu(buf: Any) -> torch.Tensor:
    return getattr(buf, "gpu", buf)


def _name(key: Any) -> str:
    return ",".join(map(str, key))
