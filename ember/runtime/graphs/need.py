"""Need order and every key's own exec, built off the request path.

Need order: the keys an engine's first requests hit come first — the engine's own first keys
when it names them, then the rest by size, smallest first (a decode server's first requests
are small batches). LOAD builds the templates in that order, hands the library over as soon as
the first one is instantiated, and builds the rest behind it.

Own execs (`Dedicator`): once the templates are built and serving starts (EMBER_DEDICATE_EARLY=1:
once the templates are built, in a cold pod while the model still builds), every key that is not
its group's template gets an exec instantiated from its own graph, in need order, on a background thread
(libember's builder: graph build + instantiate in C, no GIL), uploaded to the device there too.
A key whose exec is ready is launched through it: no `cuGraphExecUpdate` on the request path,
and no exec updated away from what it was instantiated from (on H100 an updated exec ran up to
24 % slower). Their device memory is measured (free memory before/after each batch, uploads synchronised) and
capped (`EMBER_EXEC_MEMORY_MB`, default 2048): keys past the cap stay on their group template.
A template that was switched to another key before that key's own exec was ready gets an own
exec for its template key too, at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as cu

from ember import settings
from ember.runtime.gil import short_switch_interval
from ember.runtime.graphs.driver import OK
from ember.runtime.thread_names import name_this_thread

DEFAULT_EXEC_MEMORY_MB = 2048.0
BATCH = 2  # graphs per builder call: small, so the first keys' execs are ready early


def need_order(keys: Sequence[tuple[int, ...]]) -> list[int]:
    """Indices of `keys` in the order requests need them: smallest first (a server starts with
    few requests; decode sizes grow with the load)."""
    return sorted(range(len(keys)), key=lambda i: (sum(keys[i]), keys[i]))


def exec_memory_budget() -> int:
    """Bytes all own execs may take (EMBER_EXEC_MEMORY_MB; 0 disables them)."""
    return int(max(settings.number("EMBER_EXEC_MEMORY_MB"), 0.0) * 2**20)


def free_memory() -> int | None:
    try:
        err, free, _ = cu.cuMemGetInfo()
    except RuntimeError:  # no such entry point (a stand-in driver)
        return None
    return int(free) if err == OK else None


@dataclass
class DedicateStats:
    """What the own execs cost: how many, their device memory, the keys past the cap."""

    execs: int = 0
    bytes: int = 0
    budget: int = 0
    capped: list[tuple[int, ...]] = field(default_factory=list)
    build_ms: float = 0.0  # wall time: arrays prepared + the builder calls (graph + instantiate)
    upload_ms: float = 0.0
    prepare_ms: float = 0.0  # the Python side (graph arrays from the table), mostly ahead on the pool
    failed: list[str] = field(default_factory=list)
    per_graph: list[tuple[float, float]] = field(default_factory=list)  # (build, instantiate) ms


class Dedicator:
    """Builds the own execs of a GraphLibrary on one background thread (see the module doc)."""

    def __init__(self, lib: Any, budget: int | None = None) -> None:
        self.lib = lib
        self.stats = DedicateStats(budget=exec_memory_budget() if budget is None else budget)
        self.done = threading.Event()
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, after: Sequence[threading.Event] = ()) -> threading.Thread:
        """Start once every event in `after` is set (templates built, serving started)."""

        def run() -> None:
            name_this_thread()
            try:
                for ev in after:
                    while not ev.wait(0.05):
                        if self.stop.is_set():
                            return
                with short_switch_interval():  # serving's thread wants the GIL too (gil.py)
                    self.run()
            finally:
                self.done.set()

        self._thread = threading.Thread(target=run, name="ember-dedicate", daemon=True)
        self._thread.start()
        return self._thread

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        """Own execs in need order (template keys last, only for templates switched away)."""
        lib = self.lib
        check_ctx(lib.ctx)
        todo = [i for i in lib.order if not lib.is_template(i)]
        batches = [todo[i : i + BATCH] for i in range(0, len(todo), BATCH)]
        for n, batch in enumerate(batches):
            # the next batch is prepared on the library's pool while libember builds this one
            ahead = [lib.prepare_ahead(b) for b in batches[n + 1 : n + 2]]
            done = self._batch(batch)
            self.stats.prepare_ms += sum(f.result() for f in ahead)
            if not done:
                return
        self._batch([i for i in lib.order if lib.is_template(i) and lib.template_switched(i)])
        lib.marks["dedicated"] = time.perf_counter()

    def _batch(self, indices: list[int]) -> bool:
        """One builder call; False once stopped or over the memory cap (the rest stay on templates)."""
        lib, st = self.lib, self.stats
        indices = [i for i in indices if not lib.own.has(i)]
        if not indices:
            return True
        if self.stop.is_set():
            return False
        if st.bytes >= st.budget:  # a budget of 0 makes none
            st.capped += [lib.keys[i] for i in indices]
            return False
        before = free_memory()
        t = time.perf_counter()
        try:
            for i in indices:
                lib.prepared(i)
            st.prepare_ms += (time.perf_counter() - t) * 1e3
            built = lib.own.build(indices, st.per_graph)
        except Exception as exc:  # the template keeps serving these keys
            st.failed.append(f"{[lib.keys[i] for i in indices]}: {type(exc).__name__}: {exc}"[:300])
            return True
        st.build_ms += (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        lib.upload([ex for _, ex in built])
        st.upload_ms += (time.perf_counter() - t) * 1e3
        after = free_memory()
        if before is not None and after is not None:
            st.bytes += max(before - after, 0)
        for i, ex in built:
            lib.own.adopt(i, ex)
        st.execs += len(built)
        return True


class SwapGate:
    """EMBER_SWAP_AT_LAUNCH=k (tests and diagnosis): own execs, once built, are held back until
    launch k and all take their keys there, on the launching thread: the swap from template to
    own exec at a chosen step, not wherever the background thread happens to be."""

    def __init__(self) -> None:
        at = settings.text("EMBER_SWAP_AT_LAUNCH")
        self.at = int(at) if at.isdigit() else None
        self.parked: dict[int, Any] = {}  # graph index -> own exec, held back

    def holds(self, launches: int) -> bool:
        return self.at is not None and launches < self.at

    def release(self, launches: int) -> dict[int, Any]:
        """The held execs once launch `at` has come (empty before, and after)."""
        if not self.parked or self.holds(launches):
            return {}
        out, self.parked = self.parked, {}
        return out


def check_ctx(ctx: Any) -> None:
    if ctx is not None:
        cu.cuCtxSetCurrent(ctx)
