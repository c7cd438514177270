"""Each key's own exec: instantiated from the key's own graph, beside the group templates.

A template (templates.py) serves every key of its group through exec updates, but on H100 an exec
updated to a graph ran its decode step up to 24 % slower than one instantiated from it
(benchmarks/results/switch-diag-H100-20261122-qwen3-8b.json), so the template only bridges a
key's first steps. Own execs come three ways: for a hot key (`hot_after` launches through an
updated template) on the library's pool, for every key in need order on a background thread
(`need.Dedicator`), and at once for the key LOAD's canary checks (`get`, or `get_ahead` on a
thread while the canary's first paths run). Each is adopted under the library's driver lock; with
EMBER_SWAP_AT_LAUNCH they wait for a chosen launch (`need.SwapGate`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

from cuda.bindings import driver as cu

from ember.runtime.graphs import rebuild
from ember.runtime.graphs.driver import CudaError, check
from ember.runtime.graphs.need import Dedicator, SwapGate
from ember.runtime.thread_names import name_this_thread

if TYPE_CHECKING:
    from ember.runtime.graphs.templates import GraphLibrary


class OwnExecs:
    """The own execs of a GraphLibrary's keys, by key index."""

    def __init__(self, lib: GraphLibrary, hot_after: int) -> None:
        self.lib = lib
        self.execs: dict[int, Any] = {}
        self.asked: set[int] = set()  # keys whose own exec was asked for
        self._uses: Counter[int] = Counter()  # launches through an updated template, per key
        self._pending: list[Future[None]] = []
        self._ahead: list[Future[Any]] = []  # the canary's builds (`get_ahead`): close waits for them
        self.gate = SwapGate()  # EMBER_SWAP_AT_LAUNCH: own execs swapped in at a chosen launch
        self.hot_after = 0 if self.gate.at is not None else hot_after
        self.dedicator: Dedicator | None = None

    def has(self, index: int) -> bool:
        return index in self.execs

    def build(self, indices: list[int], per_graph: list[Any] | None = None) -> list[tuple[int, Any]]:
        """Own execs of `indices` (graph + instantiate in one libember call, no driver lock held: new
        graphs; one the library already built is kept), (build, instantiate) ms per graph →
        `per_graph`."""
        lib = self.lib
        preps = [lib.prepared(i, own=True) for i in indices]
        built, nt = rebuild.build_native(preps, lib.ctx, lib.events, instantiate=True, splices=lib.splices)
        if per_graph is not None:
            per_graph += nt["per_graph"]
        out: list[tuple[int, Any]] = []
        for i, pair in zip(indices, built, strict=True):
            if pair is None or pair[1] is None:
                out.append((i, rebuild.instantiate(lib.graph(i))))
                continue
            lib.keep_graph(i, pair[0])
            out.append((i, pair[1]))
        return out

    def get(self, index: int) -> Any:
        """Key `index`'s own exec now, built as the Dedicator builds them (for LOAD's canary)."""
        if (ex := self.execs.get(index)) is None:
            ((_, ex),) = self.build([index])
            self.lib.upload([ex])
            self.adopt(index, ex)
        return self.execs.get(index) or self.gate.parked.get(index) or ex

    def get_ahead(self, index: int) -> Future[Any]:
        """`get(index)` on a thread of its own (in the library's context): LOAD's canary builds the
        key's own exec while its first paths run on the GPU, and waits only where it launches it.
        Not the library's pool: the templates still being prepared there would queue it."""
        done: Future[Any] = Future()

        def run() -> None:
            name_this_thread()
            try:
                check(cu.cuCtxSetCurrent(self.lib.ctx), "cuCtxSetCurrent")
                done.set_result(self.get(index))
            except BaseException as exc:  # the canary meets it where it launches the exec
                done.set_exception(exc)

        self._ahead.append(done)
        threading.Thread(target=run, name="ember-canary-own-exec", daemon=True).start()
        return done

    def adopt(self, index: int, ex: Any) -> None:
        with self.lib.driver_lock:
            if index in self.execs or index in self.gate.parked:
                cu.cuGraphExecDestroy(ex)
            elif self.gate.holds(self.lib.launches):
                self.gate.parked[index] = ex
            else:
                self.execs[index] = ex
                self.asked.add(index)

    def instantiate(self, index: int) -> Any:
        """An own exec for one key, instantiated from the library's graph (hot keys, the proof)."""
        ex = self.execs.get(index)
        if ex is None:
            g = self.lib.graph(index)
            with self.lib.driver_lock:
                ex = self.execs.get(index)
                if ex is None:
                    ex = self.execs[index] = rebuild.instantiate(g)
        return ex

    def drop(self, index: int) -> None:
        self.asked.discard(index)
        with self.lib.driver_lock:
            ex = self.execs.pop(index, None)
            if ex is not None:
                cu.cuGraphExecDestroy(ex)

    def used_through_template(self, index: int) -> None:
        """A launch of `index` through its updated template: hot after `hot_after` of them."""
        if not self.hot_after or index in self.asked:
            return
        self._uses[index] += 1
        if self._uses[index] >= self.hot_after:
            self.asked.add(index)
            self._pending.append(self.lib.pool.submit(self._instantiate_quietly, index))

    def _instantiate_quietly(self, index: int) -> None:
        """On a pool thread, which has no current context of its own: the library's."""
        with contextlib.suppress(CudaError):  # the template keeps serving this key
            check(cu.cuCtxSetCurrent(self.lib.ctx), "cuCtxSetCurrent")
            self.instantiate(index)

    def swap_in(self, launches: int) -> None:
        """At a launch: the execs the gate held back for it take their keys."""
        if released := self.gate.release(launches):
            with self.lib.driver_lock:
                self.execs.update(released)
                self.asked.update(released)

    def settle(self, timeout: float | None = None) -> int:
        """Wait for the hot keys' execs asked for so far; returns how many are still pending."""
        pending, self._pending = self._pending, []
        _, left = wait(pending, timeout=timeout)
        self._pending.extend(left)
        return len(left)

    def start(self, after: Iterable[threading.Event], budget: int | None) -> Dedicator:
        """Every key's own exec, in need order, on a background thread (`need.Dedicator`)."""
        self.dedicator = Dedicator(self.lib, budget)
        self.dedicator.start(list(after))
        return self.dedicator

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the Dedicator (True when no own exec is being built any more)."""
        return self.dedicator is None or self.dedicator.done.wait(timeout)

    def stop(self) -> None:
        """No build left running: the Dedicator stopped, and a canary's `get_ahead` finished (a
        canary that refused before launching it leaves it building while the library closes)."""
        if self.dedicator is not None:
            self.dedicator.stop.set()
            self.dedicator.join()
        wait(self._ahead)

    def destroy(self) -> None:
        """Every exec, adopted or held back (under the library's driver lock, at its close)."""
        for ex in [*self.execs.values(), *self.gate.parked.values()]:
            cu.cuGraphExecDestroy(ex)
        self.execs.clear()
        self.gate.parked.clear()
