"""What an inference engine provides so the one SAVE/LOAD pipeline can serve it.

`ember.runtime.save.save()` and `ember.runtime.load` own everything engine-agnostic: libember's
capture window, the random-number check, walking, SAVE's proof, the archive and its publication,
the compatibility key, the background reconstruction, the allocation replay, the templates.
An engine adapter (`ember.engines.*`) provides the six things that differ per engine:

| # | contract point            | members                                             |
|---|---------------------------|-----------------------------------------------------|
| 1 | version check             | `check_version()`, `engine`, `kind`                 |
| 2 | key enumeration           | `keys()`                                            |
| 3 | capture for SAVE, one pass| `prepare(None)`, `capture()`, `proof_subject()`     |
| 4 | sizing hints              | `facts()` (SAVE), `accept(facts)` + `prepare(...)`  |
| 5 | install restored graphs   | `static_addresses()`, `install(library, archive)`   |
| 6 | stage reports             | `report(stage, **fields)`                           |

Ordering every adapter keeps: libember is armed before the model is built (SAVE and LOAD), and
`prepare` allocates everything the graphs refer to in the same order at SAVE and at LOAD, sized
at LOAD from the archive's facts (no memory profiling), so libember's allocation log matches.
Any refusal is a `Refused(stage, reason)`: the caller captures natively.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ember.identity import ArchiveIdentity
    from ember.runtime.graphs.templates import GraphLibrary
    from ember.runtime.publish import ArchiveContent

GraphKey = tuple[int, ...]

# Refusal stages: where LOAD (or an engine check) stopped. "compat" is expected (an archive for
# other hardware or software), the others say the archive or this process is not as SAVE left it.
COMPAT, ENGINE, LOAD = "compat", "engine", "load"


class Refused(Exception):
    """This archive will not be used here; `reason` says why. Capture natively instead."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine instance as the SAVE/LOAD pipeline sees it (see the module docstring)."""

    kind: str  # the manifest's engine facts "kind", e.g. "ember-decode", "transformers-cb"

    @property
    def engine(self) -> str:
        """This process's engine string in the compatibility key (kind and version)."""
        ...

    def check_version(self) -> list[str]:
        """Why this engine's internals are not the ones the adapter knows ([] when they are)."""
        ...

    def keys(self) -> list[GraphKey]:
        """Every graph key the engine's dispatcher can ask for, in the configuration it resolved."""
        ...

    def identity(self) -> ArchiveIdentity:
        """The identity SAVE publishes under (and LOAD derives the same way)."""
        ...

    def prepare(self, facts: Mapping[str, Any] | None) -> None:
        """Allocate what the graphs refer to (weights, KV cache, static IO), in SAVE's order.
        `facts`: the archive's engine facts at LOAD (sizing hints), None at SAVE."""
        ...

    def capture(self) -> dict[GraphKey, Any]:
        """SAVE: drive the engine's own capture once per key; torch CUDAGraphs kept (keep_graph)."""
        ...

    def proof_subject(self, graphs: Mapping[GraphKey, Any]) -> Any:
        """What SAVE's proof replays and compares (`ember.runtime.proof.prove.ProofSubject`)."""
        ...

    def facts(self, graphs: Mapping[GraphKey, Any]) -> dict[str, Any]:
        """SAVE: the manifest's engine facts (`kind`, sizing, static addresses under "inputs",
        and any reference results computed with the native graphs)."""
        ...

    def accept(self, facts: Mapping[str, Any]) -> Any:
        """LOAD: refuse (Refused) an archive this engine cannot use, before its blobs are read."""
        ...

    def static_addresses(self) -> dict[str, int]:
        """The addresses the graphs bake in; LOAD compares them with SAVE's `facts["inputs"]`."""
        ...

    def install(self, library: GraphLibrary, archive: ArchiveContent) -> int:
        """LOAD: put the restored graphs where the engine's dispatcher finds them; returns how many."""
        ...

    def report(self, stage: str, **fields: Any) -> None:
        """A start-up stage reached (compat, load, capture, first_token, ready)."""
        ...


def model_config_digest(adapter: EngineAdapter) -> str:
    """The engine's `ember.identity.config_digest` of its model, "" where the adapter has none.
    SAVE records it in the facts; LOAD refuses an archive whose recorded digest differs (one
    model name and revision reused for another shape: a local path, a fine-tune's config)."""
    get = getattr(adapter, "config_digest", None)
    return str(get()) if callable(get) else ""
