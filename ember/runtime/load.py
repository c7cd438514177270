"""LOAD, for any engine adapter, in a fresh process (LD_PRELOAD=libember.so EMBER_MODE=load):
restore the graphs SAVE proved, at the same addresses, without capturing.

Order matters and every check comes before anything is launched:
1. `open_restore()` — before the engine builds its model: the manifest, the compatibility key,
   the adapter's `accept(facts)`, the allocation log imported; from here on a background thread
   reads and verifies every other blob, preloads the kernel images and builds the templates
   (`ember.runtime.restore.ArchiveRestore`);
2. `load()` — the adapter allocates in SAVE's order, sized from the archive's facts (no memory
   profiling); static buffers are checked against SAVE's addresses, the capture window replayed
   (divergence → refuse), the templates taken over and installed in the engine.
Any refusal is `Refused(stage, reason)`: capture natively instead. Never a wrong graph.

Crash safety: a launch of a bad graph can kill the process with a sticky CUDA error, and a
restarted engine must not try again. Every engine wraps its LOAD and first launches in
`ember.handoff.load_attempt` (the crash marker); `ember.handoff.wait_for_archive` turns a
leftover marker into a native-capture fallback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.native import Interposer
from ember.runtime.adapter import COMPAT, LOAD, EngineAdapter, Refused, model_config_digest
from ember.runtime.restore import ArchiveRestore, release_cached_memory
from ember.runtime.stacks import dumped_while_stuck

__all__ = ["Restored", "load", "open_restore", "release_cached_memory"]

if TYPE_CHECKING:
    from ember.runtime.graphs.templates import GraphLibrary
    from ember.runtime.publish import ArchiveContent


@dataclass
class Restored:
    """An archive restored into the engine: its templates, its content, what each step took."""

    library: GraphLibrary
    archive: ArchiveContent
    graphs: int
    timings: dict[str, Any] = field(default_factory=dict)  # as of the hand-over
    # the restore's own timings, which the background thread goes on writing (the other
    # templates); read them after `library.wait_templates()`
    background: dict[str, Any] = field(default_factory=dict)


def open_restore(
    adapter: EngineAdapter, ip: Interposer | None, store_uri: str, identity_hash: str
) -> ArchiveRestore:
    """Step 1, before the engine builds its model (Refused on any problem)."""
    problems = adapter.check_version()
    if problems:
        raise Refused(COMPAT, f"{adapter.kind}: " + "; ".join(problems))
    communicator = getattr(adapter, "communicator", None)  # multi-GPU adapters only
    return ArchiveRestore.open(
        ip, store_uri, identity_hash, adapter.engine, accept=adapter.accept,
        attached=getattr(adapter, "attached", None),  # engines with attachments only
        communicator=communicator() if communicator is not None else None,
        # an engine that issues collectives while LOAD's background thread runs has its
        # collectives captured here, before (vLLM: profile and warm-up runs on the same communicators)
        splice_now=bool(getattr(adapter, "splice_before_build", False)),
    )


def load(adapter: EngineAdapter, restore: ArchiveRestore) -> Restored:
    """Step 2: allocate, check, replay, take the templates over, install. Refused on any problem;
    what the background built is dropped then."""
    with dumped_while_stuck():
        return _load(adapter, restore)


def _load(adapter: EngineAdapter, restore: ArchiveRestore) -> Restored:
    tm: dict[str, Any] = {}
    facts = dict(restore.manifest.engine)
    try:
        t = time.perf_counter()
        adapter.prepare(facts)
        tm["prepare_ms"] = (time.perf_counter() - t) * 1e3
        config = model_config_digest(adapter)
        if facts.get("config") and config and facts["config"] != config:  # a name reused for another shape
            raise Refused(COMPAT, f"model configuration differs: archive {facts['config']}, engine {config}")
        t = time.perf_counter()
        if div := restore.ip.divergence():
            raise Refused(LOAD, f"allocation sequence diverged from SAVE: {div}")
        here = adapter.static_addresses()
        moved = {
            k: (hex(v), hex(here.get(k, 0))) for k, v in facts.get("inputs", {}).items() if here.get(k) != v
        }
        if moved:
            raise Refused(LOAD, f"static buffers are not where SAVE had them: {moved}")
        restore.replay()
        lib = restore.library()
        archive = restore.archive
        assert archive is not None  # read in full before library() returns
        count = adapter.install(lib, archive)
        tm["restore_ms"] = (time.perf_counter() - t) * 1e3
        if (verify := getattr(adapter, "verify", None)) is not None:  # before any request
            tm.update(verify(lib))
    except Refused:
        restore.abandon()
        raise
    except Exception as exc:  # the engine refused what LOAD built: still before any launch
        restore.abandon()
        raise Refused(LOAD, f"{type(exc).__name__}: {exc}") from exc
    tm.update(restore.timings)
    return Restored(lib, archive, count, tm, restore.timings)
