"""LOAD proves itself before it serves: a canary step through the restored graphs, compared bitwise
with what the engine's own path computes on the same state, on every rank.

SAVE's proof compares each rebuilt graph with the graph captured in the same process. It cannot
see a fault that only LOAD has: a per-rank value frozen at SAVE (a multi-GPU archive's SAVE plays
rank 0 and moves no data), a wrong collective splice, a kernel argument LOAD rebuilt wrongly, an
exec update that leaves a parameter stale. The canary can, for the key the first request needs:

1. a reference from a seeded state: SAVE's fingerprint of its native graph where SAVE saw real
   data (one GPU, or replicas with no collective), else the engine's own step (no graph);
2. the restored graph, launched through its group's template as instantiated, same state;
3. where the group has another member, the template updated to it and back (an exec update),
   launched again, same state;
4. the key's own exec, built as the Dedicator builds every key's, launched, same state.
Every output must equal the reference bit for bit; each path starts with the outputs poisoned.
Collectives run in each step, so on a multi-GPU shape every rank runs the canary at the same
point of its start, and the verdict is unanimous (one all-reduce): if any rank's canary fails,
every rank captures natively together (a rank alone capturing would issue its warm-up
collectives to peers that are not issuing any).

What it cannot catch, and says so in docs/runtime.md: a fault in a key other than the canary's
that the canary's key does not share (each graph's arguments are rebuilt from its own table
rows); an engine whose own step is not the captured step (a compiled step: then the canary
compares with SAVE's reference outputs where SAVE saw real data, and is skipped otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ember.runtime.adapter import Refused

# A refused canary's reason starts with CANARY_HEAD (the fallback metric's reason class is a
# reason's head); PEER_CANARY is the reason of a rank whose own canary passed but a peer's did not
CANARY_HEAD, PEER_CANARY = "canary differs", "another rank's canary failed"

VERIFY = "verify"

Outputs = Sequence[Any]  # torch tensors


def first_difference(ref: Outputs, got: Outputs) -> str:
    """'' when every tensor is equal, else where the first one differs: the first element that
    differs, how many do, and both values with their bits (one element or whole rows, a
    subnormal, the poison a skipped write leaves, garbage)."""
    import torch

    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if not isinstance(a, torch.Tensor):  # a fingerprint (SAVE's reference)
            if a != b:
                return f"output {i}: fingerprint {b}, SAVE's {a}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {tuple(b.shape)} {b.dtype}, expected {tuple(a.shape)} {a.dtype}"
        same = torch.eq(a.view(torch.uint8) if a.dtype == torch.bool else a, b).view(-1)
        if not bool(same.all()):
            differ = (~same).nonzero()
            at = int(differ[0])
            return f"output {i}: element {at} of {a.numel()} differs ({len(differ)} do): {_bits(a, b, at)}"
    return ""


_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # a view of an element's bits, by size


def _bits(a: Any, b: Any, at: int) -> str:
    """Element `at` of both tensors: its value and its bits, expected then got."""
    import torch

    kind, digits = _INTS.get(a.element_size()), 2 * a.element_size()
    shown = []
    for t in (a, b):
        flat = t.contiguous().view(-1)
        raw = int(flat.view(getattr(torch, kind))[at]) & ((1 << 4 * digits) - 1) if kind else 0
        shown.append(f"{flat[at].item()!r} (0x{raw:0{digits}x})")
    return f"expected {shown[0]}, got {shown[1]}"


def canary(
    reference: Callable[[], Outputs] | Outputs,
    graph_step: Callable[[], Outputs],
    reset: Callable[[], None],
    switch_round_trip: Callable[[], bool] | None = None,
    own_exec_step: Callable[[], Outputs] | None = None,
    every_path: bool = False,
    reset_after: bool = True,
) -> dict[str, Any]:
    """Run the canary; returns {"ok", "why", "verify_ms", "checked", "parts_ms"} (parts_ms: each
    path's milliseconds, the reference's included, and "reset": every reset's, which the paths'
    exclude). `reference`: the engine's own step (a callable) or outputs recorded before (SAVE's
    fingerprint: no step, no reset). `graph_step()` runs one step from the state `reset()` sets
    and returns copies of the outputs; `switch_round_trip()` updates the template away and back
    (False: the group has one member); `own_exec_step()` runs the key's own exec. `every_path`:
    every path even after a difference (steps that issue collectives: every rank launches the
    same sequence), the first difference kept. `reset_after`: a last reset (steps that leave
    state a request reads, e.g. the decode workload's cache rows; vLLM's dummy steps leave none)."""
    import torch

    t = time.perf_counter()
    clock = _Clock(reset)
    parts = clock.parts

    with torch.no_grad():
        if callable(reference):
            start = clock.fresh()
            ref = _snap(reference())
            clock.lap("reference", start)
        else:
            ref = list(reference)

        def updated() -> Outputs | None:
            return graph_step() if switch_round_trip is not None and switch_round_trip() else None

        paths: list[tuple[str, str, Callable[[], Outputs | None]]] = [
            ("template", "as instantiated", graph_step), ("exec update", "after an exec update", updated)]
        if own_exec_step is not None:
            paths.append(("own exec", "on its own exec", own_exec_step))
        checked: list[str] = []
        why = ""
        for name, label, step in paths:
            start = clock.fresh()
            got = step()
            if got is None:  # no other member to update to
                continue
            checked.append(name)
            diff = first_difference(ref, _snap(got))
            clock.lap(name, start)
            if diff and not why:
                why = f"{label}: {diff}"
            if why and not every_path:
                break
        if reset_after:
            clock.fresh()
    parts["reset"] = round(clock.resets, 2)
    return {"ok": not why, "why": why, "checked": checked, "verify_ms": (time.perf_counter() - t) * 1e3,
            "parts_ms": parts}


def _snap(outputs: Outputs) -> list[Any]:
    """Copies of a step's outputs (the next path's step writes the same memory)."""
    import torch

    return [x.clone() if isinstance(x, torch.Tensor) else x for x in outputs]


class _Clock:
    """The canary's parts: each path's milliseconds from the end of its reset (its step and its
    comparison), every reset's summed apart."""

    def __init__(self, reset: Callable[[], None]) -> None:
        self.reset, self.resets = reset, 0.0
        self.parts: dict[str, float] = {}

    @staticmethod
    def sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def fresh(self) -> float:
        """The state every path starts from; returns when the path's own time starts."""
        since = time.perf_counter()
        self.reset()
        self.sync()
        now = time.perf_counter()
        self.resets += (now - since) * 1e3
        return now

    def lap(self, name: str, since: float) -> None:
        self.sync()
        self.parts[name] = round((time.perf_counter() - since) * 1e3, 2)


def unanimous(ok: bool, world: int) -> bool:
    """Every rank's verdict at once (MIN over the world; one rank's own verdict in a world of one)."""
    if world <= 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def round_trip(library: Any, index: int, other: int | None = None) -> Callable[[], bool]:
    """`switch_round_trip` for graph `index` of a GraphLibrary: its template exec-updated to
    `other` (default: the first other member of its group) and back (False: the group has one
    member)."""

    def run() -> bool:
        nonlocal other
        if other is None:
            other = next((m for m in library.group_members(index) if m != index), None)
        if other is None:
            return False
        library.switch(other)
        library.switch(index)
        return True

    return run


def settle(result: dict[str, Any], world: int, rank: int,
           agree: Callable[[bool], bool] | None = None) -> dict[str, Any]:
    """What LOAD's timings record of a passed canary; Refused(VERIFY) unless every rank's passed."""
    refuse_unless(result, world, rank, agree)
    return {"verify_ms": result["verify_ms"], "verify": "+".join(result["checked"]),
            "verify_parts": result.get("parts_ms", {})}


def refuse_unless(result: dict[str, Any], world: int, rank: int,
                  agree: Callable[[bool], bool] | None = None) -> None:
    """Raise Refused(VERIFY) unless every rank's canary passed. `agree(ok)`: the engine's own
    vote (every rank's verdict at once) instead of `unanimous` over torch's default group."""
    ok = bool(result["ok"])
    if (agree(ok) if agree is not None else unanimous(ok, world)):
        return
    why = result["why"] or PEER_CANARY
    raise Refused(VERIFY, f"{CANARY_HEAD}: rank {rank}: restored graphs do not compute what the engine "
                          f"does: {why}")
